"""A stand-in Kubernetes API server at the HTTP level (no cluster can run on these machines).

The real kubernetes Python client talks to it, so its serialization, server-side
apply, list/watch streaming and error handling all run. It implements only what
eagle-jobs uses, following the documented conventions:

- Paths, verbs, List objects and `resourceVersion`: Kubernetes API concepts
  (kubernetes.io/docs/reference/using-api/api-concepts/): collections under
  /api/v1 and /apis/<group>/<version>, `?labelSelector=` (equality-based: =, ==, !=),
  `?fieldSelector=metadata.name=`, `?watch=true&resourceVersion=&timeoutSeconds=`
  streaming newline-delimited `{"type": ADDED|MODIFIED|DELETED|ERROR, "object": ...}`;
  a resourceVersion older than the server keeps gives an ERROR event carrying
  Status code 410 (reason Expired), as the docs' "410 Gone" section says.
- Errors are `Status` objects (kind Status, status Failure, reason, code):
  404 NotFound, 409 Conflict, 422 Invalid, 400 BadRequest, 415 (API conventions,
  sig-architecture/api-conventions.md "Response Status Kind").
- Server-side apply (kubernetes.io/docs/reference/using-api/server-side-apply/):
  PATCH with Content-Type application/apply-patch+yaml; `fieldManager` is
  required; applying over fields another manager owns without `force=true` is a
  409 Conflict; 201 on create, 200 on update; `metadata.managedFields` records
  the manager with operation Apply.
- JobSet (jobset.x-k8s.io/v1alpha2, kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go):
  `spec.replicatedJobs` is immutable after creation (422 from its webhook);
  status conditions of type Completed, Failed, Suspended.
- Job status (batch/v1): conditions Complete / Failed (reasons BackoffLimitExceeded,
  DeadlineExceeded, FailedIndexes, PodFailurePolicy), `completedIndexes`,
  `failedIndexes`, `active`, `succeeded`, `failed`.
- Pod logs: GET .../pods/<name>/log?container= returns text/plain. A pod with no node yet gives
  400 "pod X does not have a host assigned" (apiserver, pkg/registry/core/pod/strategy.go
  LogLocation); a container that is waiting gives 400 "container X in pod Y is waiting to start:
  <reason>" (kubelet, pkg/kubelet/kubelet_pods.go validateContainerLogStatus).
- Events (core/v1) are listed with `?fieldSelector=involvedObject.name=<pod>`.

Tests act as the controllers: `put()` creates Jobs and Pods, `set_status()` moves
them; `drop_next_watch` closes the next watch connection mid-stream.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

ITEM = [re.compile(r"^(?P<coll>/api/v1/namespaces)/(?P<name>[^/]+)$"),
        re.compile(r"^(?P<coll>/api/v1/namespaces/[^/]+/[a-z]+)/(?P<name>[^/]+)$"),
        re.compile(r"^(?P<coll>/apis/[^/]+/[^/]+/namespaces/[^/]+/[a-z]+)/(?P<name>[^/]+)$")]
COLL = re.compile(r"^(/api/v1/namespaces|/api/v1/namespaces/[^/]+/[a-z]+|/apis/[^/]+/[^/]+/namespaces/[^/]+/[a-z]+)$")
LOG = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log$")


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeKube:
    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.events: list[tuple[int, str, str, dict]] = []  # (rv, collection, type, object)
        self.rv = 100
        self.oldest_rv = 0  # events before this are "compacted": watching from older gives 410
        self.logs: dict[tuple[str, str], str] = {}
        self.lock = threading.Condition()
        self.drop_next_watch = False
        self.requests: list[tuple[str, str]] = []
        # the API server's create-time checks of a custom resource (its CRD schema, validating webhooks):
        # (object, current object or None) -> the Status it refuses with, or None. tests/jobset_admission.py
        self.admit = None

    # -- controller side (tests) -----------------------------------------------------------
    def _bump(self, coll: str, typ: str, obj: dict) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, coll, typ, json.loads(json.dumps(obj))))
        self.lock.notify_all()

    def put(self, coll: str, obj: dict) -> dict:
        with self.lock:
            md = obj.setdefault("metadata", {})
            md.setdefault("uid", str(uuid.uuid4()))
            md.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            typ = "MODIFIED" if (coll, md["name"]) in self.objects else "ADDED"
            self.objects[(coll, md["name"])] = obj
            self._bump(coll, typ, obj)
            return obj

    def set_status(self, coll: str, name: str, st: dict) -> None:
        with self.lock:
            obj = self.objects[(coll, name)]
            obj["status"] = st
            self._bump(coll, "MODIFIED", obj)

    def delete(self, coll: str, name: str) -> None:
        with self.lock:
            obj = self.objects.pop((coll, name))
            self._bump(coll, "DELETED", obj)

    def compact(self) -> None:
        with self.lock:
            self.oldest_rv = self.rv + 1

    def get(self, coll: str, name: str) -> dict | None:
        return self.objects.get((coll, name))

    # -- API ----------------------------------------------------------------------------------
    @staticmethod
    def _matches(obj: dict, q: dict) -> bool:
        for sel in q.get("labelSelector", []):
            labels = obj["metadata"].get("labels") or {}
            for term in filter(None, sel.split(",")):
                if "!=" in term:  # "!=": the label differs or is absent (equality-based requirements, labels docs)
                    k, _, v = term.partition("!=")
                    if labels.get(k) == v:
                        return False
                    continue
                k, _, v = term.partition("=")
                if labels.get(k) != v.removeprefix("="):  # "=" and "==" are the same requirement
                    return False
        for sel in q.get("fieldSelector", []):
            for term in filter(None, sel.split(",")):
                k, _, v = term.partition("=")
                cur = obj
                for part in k.split("."):
                    cur = cur.get(part) if isinstance(cur, dict) else None
                if cur != v:
                    return False
        return True

    def pod_log(self, ns: str, name: str, container: str) -> tuple[int, object]:
        pod = self.objects.get((f"/api/v1/namespaces/{ns}/pods", name))
        if pod is None:
            return 404, status(404, "NotFound", f"pods \"{name}\" not found")
        if not pod.get("spec", {}).get("nodeName") and not (pod.get("status") or {}).get("containerStatuses"):
            return 400, status(400, "BadRequest", f"pod {name} does not have a host assigned")
        st = pod.get("status") or {}
        cs = {c["name"]: c
              for c in st.get("initContainerStatuses", []) + st.get("containerStatuses", [])}.get(container)
        if cs is None or "waiting" in (cs.get("state") or {}):
            reason = ((cs or {}).get("state", {}).get("waiting") or {}).get("reason", "PodInitializing")
            return 400, status(400, "BadRequest",
                               f"container \"{container}\" in pod \"{name}\" is waiting to start: {reason}")
        text = self.logs.get((ns, name, container))
        if text is None and container == "worker":
            text = self.logs.get((ns, name))
        return 200, text or ""

    def apply(self, coll: str, name: str, body: dict, q: dict, content_type: str) -> tuple[int, dict]:
        if content_type.split(";")[0] != "application/apply-patch+yaml":
            return 415, status(415, "UnsupportedMediaType",
                               "the body of the request was in an unknown format - accepted media types include: "
                               f"application/apply-patch+yaml; got {content_type}")
        manager = (q.get("fieldManager") or [None])[0]
        if not manager:
            return 400, status(400, "BadRequest", "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: "
                                                  "Required value: is required for apply patch")
        force = (q.get("force") or ["false"])[0] == "true"
        with self.lock:
            cur = self.objects.get((coll, name))
            refused = self.admit(body, cur) if self.admit is not None else None
            if refused is not None:
                return refused["code"], refused
            if cur is not None:
                owners = {m["manager"] for m in cur["metadata"].get("managedFields", [])}
                if owners - {manager} and not force:
                    other = sorted(owners - {manager})[0]
                    return 409, status(409, "Conflict",
                                       f"Apply failed with 1 conflict: conflict with \"{other}\": .spec")
                if (body.get("kind") == "JobSet"
                        and cur.get("spec", {}).get("replicatedJobs") != body.get("spec", {}).get("replicatedJobs")):
                    return 422, status(422, "Invalid",
                                       f"JobSet.jobset.x-k8s.io \"{name}\" is invalid: spec.replicatedJobs: "
                                       "Invalid value: \"object\": field is immutable")
            obj = json.loads(json.dumps(body))
            md = obj.setdefault("metadata", {})
            md["managedFields"] = [{"manager": manager, "operation": "Apply", "apiVersion": obj.get("apiVersion"),
                                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "fieldsType": "FieldsV1", "fieldsV1": {}}]
            if cur is not None:
                md["uid"] = cur["metadata"]["uid"]
                md["creationTimestamp"] = cur["metadata"]["creationTimestamp"]
                if "status" in cur:
                    obj["status"] = cur["status"]
                unchanged = ({k: v for k, v in cur.items() if k != "metadata"}
                             == {k: v for k, v in obj.items() if k != "metadata"})
                self.objects[(coll, name)] = obj
                if unchanged:
                    md["resourceVersion"] = cur["metadata"]["resourceVersion"]
                else:
                    self._bump(coll, "MODIFIED", obj)
                return 200, obj
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.objects[(coll, name)] = obj
            self._bump(coll, "ADDED", obj)
            return 201, obj

    def start(self) -> str:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, obj, ctype="application/json") -> None:
                data = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PATCH(self):
                u = urlparse(self.path)
                fake.requests.append(("PATCH", u.path))
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                for rx in ITEM:
                    m = rx.match(u.path)
                    if m:
                        code, obj = fake.apply(m["coll"], m["name"], body, parse_qs(u.query),
                                               self.headers.get("Content-Type", ""))
                        return self._send(code, obj)
                self._send(404, status(404, "NotFound", f"the server could not find the requested resource {u.path}"))

            def do_GET(self):
                u = urlparse(self.path)
                q = parse_qs(u.query)
                fake.requests.append(("GET", u.path + ("?watch" if q.get("watch") else "")))
                m = LOG.match(u.path)
                if m:
                    code, body = fake.pod_log(m["ns"], m["name"], (q.get("container") or ["worker"])[0])
                    return self._send(code, body, "text/plain" if code == 200 else "application/json")
                if COLL.match(u.path):
                    if q.get("watch") == ["true"]:
                        return self._watch(u.path, q)
                    with fake.lock:
                        items = [o for (c, _n), o in sorted(fake.objects.items())
                                 if c == u.path and fake._matches(o, q)]
                        kind = (items[0]["kind"] if items else "Object") + "List"
                        return self._send(200, {"kind": kind, "apiVersion": "v1",
                                                "metadata": {"resourceVersion": str(fake.rv)}, "items": items})
                for rx in ITEM:
                    m = rx.match(u.path)
                    if m:
                        obj = fake.get(m["coll"], m["name"])
                        if obj is None:
                            resource = m["coll"].rsplit("/", 1)[-1]
                            return self._send(404, status(404, "NotFound", f"{resource} \"{m['name']}\" not found"))
                        return self._send(200, obj)
                self._send(404, status(404, "NotFound", "the server could not find the requested resource"))

            def _watch(self, coll: str, q: dict):
                rv = int((q.get("resourceVersion") or ["0"])[0] or 0)
                timeout = float((q.get("timeoutSeconds") or ["30"])[0])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(obj) -> None:
                    data = (json.dumps(obj) + "\n").encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                if rv and rv < fake.oldest_rv:
                    chunk({"type": "ERROR",
                           "object": status(410, "Expired", f"too old resource version: {rv} ({fake.oldest_rv})")})
                    self.wfile.write(b"0\r\n\r\n")
                    return
                end = time.monotonic() + timeout
                with fake.lock:
                    drop = fake.drop_next_watch
                    fake.drop_next_watch = False
                if drop:  # the connection dies mid-stream (load balancer, apiserver restart)
                    self.close_connection = True
                    self.wfile.write(b"5\r\n{\"typ")
                    self.wfile.flush()
                    return
                sent = rv
                while time.monotonic() < end:
                    with fake.lock:
                        evs = [e for e in fake.events if e[0] > sent and e[1] == coll and fake._matches(e[3], q)]
                        if not evs:
                            fake.lock.wait(timeout=min(0.2, max(0.0, end - time.monotonic())))
                            continue
                    for erv, _c, typ, obj in evs:
                        chunk({"type": typ, "object": obj})
                        sent = erv
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
