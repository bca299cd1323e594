"""One row of a prompt set as OpenAI messages, or the reason it is rejected (eagle_jobs.prompts reads the
rows and counts the rejects).

A row is an OpenAI `messages` list, a ShareGPT `conversations` list (roles mapped by SHAREGPT_ROLES; any
other `from` is rejected, never guessed), or a recorded chat-completions request: its body, a batch line
or a gateway's log record (see eagle_jobs.prompts).
"""

from __future__ import annotations

ROLES = {"system", "user", "assistant", "tool", "developer"}
# ShareGPT's `from` values seen in the wild (ShareGPT V3, Vicuna, EAGLE's data scripts)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}
REASONS = ("empty", "binary", "not_json", "no_messages", "wrong_type", "unknown_role", "no_content", "no_user_turn")


class BadRow(Exception):
    """A row that is not a conversation: the reason (one of REASONS) and what is wrong, for Rejects."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def _content(value: object, where: str) -> str | list | None:
    if value is None or isinstance(value, str | list):
        return value
    raise BadRow("wrong_type", f"{where} must be a string")


def _request_body(obj: dict) -> dict | None:
    """The chat-completions request a traffic row records, or None for a conversation row."""
    if isinstance(obj.get("body"), dict) and "url" in obj:  # a batch line
        if not str(obj["url"]).endswith("/chat/completions"):
            raise BadRow("wrong_type", f"a batch line for {obj['url']!r}: only /v1/chat/completions requests "
                                     "are prompts")
        return obj["body"]
    if isinstance(obj.get("request"), dict):  # a gateway's log record
        return obj["request"]
    return obj if "model" in obj and "messages" in obj else None  # a request body: `model` is required


def _text_parts(content: object, where: str) -> object:
    """A request's content as text: OpenAI's list of {"type": "text", "text"} parts joined; other
    parts (images, audio) are not what a text draft is measured on."""
    if not isinstance(content, list):
        return content
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise BadRow("wrong_type", f"{where} has parts other than text")
    return "".join(p["text"] for p in content)


def parse_row(obj: object) -> tuple[list[dict], bool]:
    """One row as OpenAI messages, and whether it is a recorded request; or BadRow with the reason."""
    if not isinstance(obj, dict):
        raise BadRow("wrong_type", "a row must be a JSON object")
    body = _request_body(obj)
    if body is None:
        return row_messages(obj), False
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise BadRow("no_messages", "a recorded request without a 'messages' list")
    msgs = [{**m, "content": _text_parts(m.get("content"), f"messages[{i}].content")} if isinstance(m, dict) else m
            for i, m in enumerate(raw)]
    return row_messages({"messages": msgs}), True


def row_messages(obj: object) -> list[dict]:
    """One row as OpenAI messages, or BadRow with the reason."""
    if not isinstance(obj, dict):
        raise BadRow("wrong_type", "a row must be a JSON object")
    if "messages" in obj:
        raw, key = obj["messages"], "messages"
    elif "conversations" in obj:
        raw, key = obj["conversations"], "conversations"
    else:
        raise BadRow("no_messages", "no 'messages' (OpenAI) or 'conversations' (ShareGPT) list")
    if not isinstance(raw, list):
        raise BadRow("wrong_type", f"'{key}' must be a list")
    if not raw:
        raise BadRow("no_messages", f"'{key}' is empty")
    msgs = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRow("wrong_type", f"{key}[{i}] must be an object")
        if key == "messages":
            role, content = m.get("role"), _content(m.get("content"), f"messages[{i}].content")
            if role not in ROLES:
                raise BadRow("unknown_role", f"messages[{i}] has unknown role {role!r} (use one of {sorted(ROLES)})")
        else:
            speaker = m.get("from")
            if speaker not in SHAREGPT_ROLES:
                raise BadRow("unknown_role", f"conversations[{i}] has unknown role {speaker!r} in 'from' "
                                           f"(known: {sorted(SHAREGPT_ROLES)})")
            role, content = SHAREGPT_ROLES[speaker], _content(m.get("value"), f"conversations[{i}].value")
        if role in ("user", "system") and not content:
            raise BadRow("no_content", f"{key}[{i}] ({role}) has no content")
        msgs.append({"role": role, "content": content or ""})
    if not any(m["role"] == "user" for m in msgs):
        raise BadRow("no_user_turn", "the conversation has no user turn")
    return msgs
