"""What the API server does with a JobSet at create, for the oldest and newest JobSet we support.

A stand-in, ported from the sources at each tag (tests/schemas/README.md says where the CRDs come from):

1. The CRD's openAPIV3Schema. The API server validates a custom resource against it and turns an
   enum failure into field.NotSupported ("Unsupported value: ...: supported values: ...") -
   kubernetes/apiextensions-apiserver v0.33.0 pkg/apiserver/validation/validation.go
   kubeOpenAPIResultToFieldErrors (EnumFailCode) - answering 422 Invalid with
   `<Kind>.<group> "<name>" is invalid: <errors>` (kubernetes/apimachinery v0.36.0
   pkg/api/errors/errors.go NewInvalid; one error alone, several as "[a, b]":
   pkg/util/errors/errors.go aggregate.Error). Unknown fields are pruned, not refused; tests lint
   them separately with a strict copy of the schema.
2. JobSet's validating webhook `vjobset.kb.io` (kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go,
   ValidateCreate and validateFailurePolicy at v0.8.2 and v0.12.0), with its feature gates
   (pkg/features/features.go at v0.12.0: RestartJob and InPlaceRestart default off).
3. How a refusal reaches the client. v0.8.2 returns errors.Join(...), a plain error, which
   controller-runtime v0.20.2 turns into Denied: 403 Forbidden (pkg/webhook/admission/validator_custom.go
   ValidateCreate's `return Denied(err.Error())`, response.go ValidationResponse). v0.12.0 returns
   apierrors.NewInvalid (invalidError, plain errors wrapped as field.InternalError(nil, err), whose path
   prints "<nil>": apimachinery pkg/util/validation/field/path.go Path.String): 422 Invalid, passed on as
   is (controller-runtime v0.24.0 validationResponseFromStatus). The API server prefixes the message with
   `admission webhook "vjobset.kb.io" denied the request: ` (kubernetes/apiserver v0.33.0
   pkg/admission/plugin/webhook/errors/statuserror.go ToStatusErr).

Only the checks a JobSet of ours can reach are ported; a JobSet that sets a field whose check is not
ported (coordinator, managedBy, network.subdomain, volumeClaimPolicies) is refused here with a note to
port it first, so this stand-in never admits what it has not looked at.
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path

import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas"
OLDEST, NEWEST = "v0.8.2", "v0.12.0"
VERSIONS = (OLDEST, NEWEST)
WEBHOOK = "vjobset.kb.io"  # the kubebuilder marker above ValidateCreate: name=vjobset.kb.io
GROUP_KIND = "JobSet.jobset.x-k8s.io"
# pkg/features/features.go (v0.12.0): {Default: false, PreRelease: Alpha}; v0.8.2 has no gates
GATED = {"v0.12.0": {"RestartJob", "InPlaceRestart"}}
# validOnJobFailureReasons (both tags): batchv1.JobReason* constants
JOB_FAILURE_REASONS = ["BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"]
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # ruleNameFmt
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # apimachinery validation.go dns1035LabelFmt
DNS1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
               "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
               "regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
MAX_INT32 = 2**31 - 1
UNPORTED = ("coordinator", "managedBy", "volumeClaimPolicies")


def crd_path(version: str) -> Path:
    return SCHEMAS / f"jobset.x-k8s.io_jobsets.{version}.yaml"


@cache
def _schema_json(version: str) -> str:
    crd = yaml.safe_load(crd_path(version).read_text())
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema = ver["schema"]["openAPIV3Schema"]
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is the API server's, not the CRD's
    return json.dumps(schema)


def schema(version: str, strict: bool = False) -> dict:
    """The CRD's v1alpha2 schema; strict: unknown fields refused (a lint: the API server prunes them)."""
    s = json.loads(_schema_json(version))
    return _strict(s) if strict else s


def _strict(s):
    if isinstance(s, dict):
        out = {k: _strict(v) for k, v in s.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(s, list):
        return [_strict(v) for v in s]
    return s


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _quote(v) -> str:
    return json.dumps(v) if isinstance(v, str) else json.dumps(v, separators=(",", ":"))


def schema_errors(js: dict, version: str, strict: bool = False) -> list[str]:
    """Field errors as the API server prints them (enum: field.NotSupported; others: Invalid value)."""
    import jsonschema

    errors = []
    for e in sorted(jsonschema.Draft7Validator(schema(version, strict)).iter_errors(js), key=lambda e: list(e.path)):
        where = _path(e.absolute_path)
        if e.validator == "enum":
            errors.append(f"{where}: Unsupported value: {_quote(e.instance)}: supported values: "
                          + ", ".join(json.dumps(v) for v in e.validator_value))
        else:
            errors.append(f"{where}: Invalid value: {e.message}")
    return errors


def _dns1035(value: str) -> list[str]:
    errs = ["must be no more than 63 characters"] if len(value) > 63 else []
    return errs + ([] if DNS1035.match(value) else [DNS1035_MSG])


def webhook_errors(js: dict, version: str, gates: frozenset[str] = frozenset()) -> list[tuple[str | None, str]]:
    """ValidateCreate at `version`: (field path or None for a plain error, message), in its order."""
    spec = js["spec"]
    for f in UNPORTED:
        assert f not in spec, f"the stand-in does not port the webhook's {f} check: port it first"
    assert "subdomain" not in (spec.get("network") or {}), "port the webhook's network.subdomain check first"
    off = GATED.get(version, set()) - set(gates)
    errs: list[tuple[str | None, str]] = []
    fp = spec.get("failurePolicy") or {}
    if "InPlaceRestart" in off and fp.get("restartStrategy") == "InPlaceRestart":
        errs.append((None,
                     "InPlaceRestart restart strategy cannot be set when InPlaceRestart feature gate is disabled"))
    rjobs = spec["replicatedJobs"]
    if rjobs and rjobs[0].get("dependsOn") is not None:
        errs.append((None, "DependsOn can't be set for the first ReplicatedJob"))
    name, seen = js["metadata"]["name"], []
    for i, rj in enumerate(rjobs):
        seen.append(rj["name"])  # both tags record the name before checking its dependsOn
        tpl, replicas = rj["template"]["spec"], rj.get("replicas", 1)
        if tpl.get("parallelism", 1) * replicas > MAX_INT32:
            errs.append((None, f"the product of replicas and parallelism must not exceed {MAX_INT32} for "
                               f"replicatedJob '{rj['name']}'"))
        if version != OLDEST:  # groupName arrived after v0.8; the CRD defaults it to "default"
            errs += [(f"spec.replicatedJobs[{i}].groupName", m) for m in _dns1035(rj.get("groupName", "default"))]
        job = f"{name}-{rj['name']}-{replicas - 1}"  # placement.GenJobName, the largest job index
        too_long = "JobSet name is too long, {} names generated for this JobSet will exceed 63 characters"
        errs += [(f"spec.replicatedJobs[{i}].name", too_long.format("job") if m.startswith("must be no more")
                  else m) for m in _dns1035(job)]
        if tpl.get("completionMode") == "Indexed" and tpl.get("completions") is not None:
            pod = f"{job}-{tpl['completions'] - 1}-abcde"  # placement.GenPodName + the 5 random characters
            errs += [(f"spec.replicatedJobs[{i}].name", too_long.format("pod") if m.startswith("must be no more")
                      else m) for m in _dns1035(pod)]
        deps = (rj.get("dependsOn") or [])[:1] if version == OLDEST else rj.get("dependsOn") or []  # v0.8.2: [0] only
        errs += [(None, f"replicatedJob: {rj['name']} cannot depend on replicatedJob: {d['name']}")
                 for d in deps if d["name"] not in seen]
    names = [rj["name"] for rj in rjobs]
    errs += [(None, f"invalid replicatedJob name '{t}' does not appear in .spec.ReplicatedJobs")
             for t in (spec.get("successPolicy") or {}).get("targetReplicatedJobs") or [] if t not in names]
    if spec.get("failurePolicy") is not None:
        errs += [(None, m) for m in _failure_policy_errors(fp, rjobs, version, off)]
    return errs


def _failure_policy_errors(fp: dict, rjobs: list[dict], version: str, off: set[str]) -> list[str]:
    """validateFailurePolicy at `version`."""
    errs: list[str] = []
    rules = fp.get("rules") or []
    if version != OLDEST and any(r.get("action") in ("RestartJob", "RestartJobAndIgnoreMaxRestarts") for r in rules):
        if "RestartJob" in off:
            return ["RestartJob and RestartJobAndIgnoreMaxRestarts failure policy actions are not allowed when "
                    "RestartJob feature gate is disabled"]  # the webhook returns early here
        if any(rj.get("replicas", 1) > 1024 for rj in rjobs):
            errs.append("JobSet cannot have a failure policy rule with RestartJob or RestartJobAndIgnoreMaxRestarts "
                        "action and a replicated job with replicas > 1024")
    names = [rj["name"] for rj in rjobs]
    by_name: dict[str, list[int]] = {}
    for i, rule in enumerate(rules):
        rule_name = rule.get("name") or f"failurePolicyRule{i}"  # the mutating webhook's Default names it
        if not 1 <= len(rule_name) <= 128:
            errs.append(f"invalid failure policy rule name of length {len(rule_name)}, the rule name must be at "
                        "least 1 characters long and at most 128 characters long")
        by_name.setdefault(rule_name, []).append(i)
        if not RULE_NAME.match(rule_name):
            errs.append(f"invalid failure policy rule name '{rule_name}', a failure policy rule name must start with "
                        "an alphabetic character, optionally followed by a string of alphanumeric characters or "
                        "'_,:', and must end with an alphanumeric character or '_'")
        errs += [f"invalid replicatedJob name '{t}' in failure policy does not appear in .spec.ReplicatedJobs"
                 for t in rule.get("targetReplicatedJobs") or [] if t not in names]
        errs += [f"invalid job failure reason '{r}' in failure policy is not a recognized job failure reason"
                 for r in rule.get("onJobFailureReasons") or [] if r not in JOB_FAILURE_REASONS]
    errs += [f"rule names are not unique, rules with indices [{' '.join(map(str, idx))}] all have the same name '{n}'"
             for n, idx in by_name.items() if len(idx) > 1]  # Go's %v prints []int as [0 1]
    return errs


def _invalid(name: str, errors: list[str]) -> str:
    """apierrors.NewInvalid's message."""
    body = errors[0] if len(errors) == 1 else "[" + ", ".join(dict.fromkeys(errors)) + "]"
    return f'{GROUP_KIND} "{name}" is invalid: {body}'


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def create_status(js: dict, version: str, gates: frozenset[str] = frozenset()) -> dict | None:
    """The Status the API server answers a create of `js` with where JobSet `version` is installed
    (None: admitted). The schema first (the registry's strategy Validate), then the webhook."""
    js = copy.deepcopy(js)
    name = js["metadata"]["name"]
    errs = schema_errors(js, version)
    if errs:
        return status(422, "Invalid", _invalid(name, errs))
    hook = webhook_errors(js, version, gates)
    if not hook:
        return None
    denied = f'admission webhook "{WEBHOOK}" denied the request: '
    if version == OLDEST:  # errors.Join: one per line; controller-runtime's Denied
        return status(403, "Forbidden", denied + "\n".join(m for _f, m in hook))
    fields = [f"{f or '<nil>'}: " + (f"Invalid value: {json.dumps(_bad(js, f))}: {m}" if f else f"Internal error: {m}")
              for f, m in hook]
    return status(422, "Invalid", denied + _invalid(name, fields))


def _bad(js: dict, path: str):
    """The bad value a field error prints: the generated name for names, the group name for groupName."""
    m = re.fullmatch(r"spec\.replicatedJobs\[(\d+)\]\.(\w+)", path)
    rj = js["spec"]["replicatedJobs"][int(m[1])]
    if m[2] == "groupName":
        return rj.get("groupName", "default")
    return f"{js['metadata']['name']}-{rj['name']}-{rj.get('replicas', 1) - 1}"


def admit(version: str, gates: frozenset[str] = frozenset()):
    """A FakeKube.admit hook: what the API server says to a JobSet create at this JobSet version."""
    def hook(obj: dict, current: dict | None) -> dict | None:
        if obj.get("kind") != "JobSet" or current is not None:
            return None
        return create_status(obj, version, gates)
    return hook


def update_status(old: dict, new: dict, version: str) -> dict | None:
    """ValidateUpdate at `version`: replicatedJobs (and managedBy) are immutable, except a suspended JobSet's pod
    template labels, annotations, nodeSelector, tolerations and schedulingGates (for Kueue), which this
    stand-in does not port (none of our updates is one). v0.8.2 returns errs.ToAggregate(), a plain error:
    403 Forbidden through controller-runtime's Denied; v0.12.0 apierrors.NewInvalid: 422 Invalid (line 402)."""
    assert not (old["spec"].get("suspend") or new["spec"].get("suspend")), "port the suspended-JobSet exception first"
    errs = [f"spec.{f}: Invalid value: {json.dumps(new['spec'].get(f), separators=(',', ':'))}: field is immutable"
            for f in ("replicatedJobs", "managedBy") if old["spec"].get(f) != new["spec"].get(f)]
    if not errs:
        return None
    denied = f'admission webhook "{WEBHOOK}" denied the request: '
    if version == OLDEST:
        return status(403, "Forbidden", denied + (errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"))
    return status(422, "Invalid", denied + _invalid(new["metadata"]["name"], errs))
