"""Ray Serve as two tiers: a real local Ray, an ingress and 2 CPU model replicas of the tiny random model (SmolLM2's
tokenizer and template; every check here is plumbing: placement, streaming, cancelling, loopback, routing by name).

Everything stays on 127.0.0.1 (checked with ``ss``); 16 concurrent clients stream through the proxy and the
ingress and get the in-process answer; both replicas serve; a conversation's follow-up turns all go to the
replica that holds its prefix; a client that drops is cancelled on its replica. Then, in the same Ray, several
models: a deployment per model behind one ingress, a request's ``model`` picking the deployment (the OpenAI
endpoints, and ChatExLlama by ``model=``), unknown models refused typed, metrics per model.
"""

from __future__ import annotations

import pytest

from helpers import run_isolated

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, os, socket, subprocess, threading, time
from exllama_integrations.serve.ray.network import before_ray_starts
before_ray_starts("127.0.0.1")  # as `serve --ray` does: the node on 127.0.0.1, a busy machine's proxy waited for
import httpx, ray
from ray import serve
from exllama_integrations.serve.ray import build_app

MODEL_DIR = {model_dir!r}
NAME = os.path.basename(MODEL_DIR)
TINY_A, TINY_B = {tiny_a!r}, {tiny_b!r}
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
out = {{}}
t0 = time.perf_counter()
ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
serve.start(http_options={{"host": "127.0.0.1", "port": port}})
app = build_app({{"model_dir": MODEL_DIR, "backend": "transformers", "num_replicas": 2, "num_gpus": 0,
                  "num_cpus": 1, "max_ongoing_requests": 32}})
serve.run(app, name="exllama", route_prefix="/")
out["up_s"] = time.perf_counter() - t0
url = f"http://127.0.0.1:{{port}}"
prompt = "The capital of France is"
want = httpx.post(url + "/v1/completions", json={{"model": NAME, "prompt": prompt,
                  "max_tokens": 16, "temperature": 0}}, timeout=120).json()["choices"][0]["text"]
results = []
def client(i):
    body = {{"model": NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0,
             "stream": True}}
    t = time.perf_counter(); arrivals = []; text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {{"):
                arrivals.append(time.perf_counter() - t)
                text.append(json.loads(line[6:])["choices"][0]["text"])
    results.append({{"text": "".join(text), "chunks": len(arrivals), "first": arrivals[0], "last": arrivals[-1]}})
threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
for t in threads: t.start()
for t in threads: t.join(300)
out["clients"] = results
out["want"] = want
out["placement"] = httpx.get(url + "/health", timeout=30).json()["replicas"]
# a conversation longer than one 256-token block, then its follow-up turns: all to the replica that holds it
convo = "A long conversation about llamas and their wool. " * 40
def ask(text):
    return httpx.post(url + "/v1/completions", json={{"prompt": text, "max_tokens": 2, "temperature": 0}},
                      timeout=120).json()["choices"][0]["text"]
before = dict(httpx.get(url + "/health", timeout=30).json()["replicas"])
ask(convo)
turns = [ask(convo + f" Turn {{i}}: and then?") for i in range(6)]
after = httpx.get(url + "/health", timeout=30).json()["replicas"]
out["follow_up_placement"] = {{k: after.get(k, 0) - before.get(k, 0) for k in after}}
handle = serve.get_deployment_handle("ExLlamaModel", app_name="exllama")
body = {{"model": NAME, "prompt": "Tell me a long story.", "max_tokens": 400,
         "ignore_eos": True, "stream": True}}
with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
    lines = r.iter_lines()
    for _ in range(4): next(lines)
time.sleep(2)
out["in_flight_after_drop"] = max(httpx.get(url + "/health", timeout=30).json()["in_flight"] for _ in range(20))
seen = {{}}
for _ in range(40):  # ask the replicas what they still run (a dropped client's generation must have ended)
    a = handle.active.remote().result()
    seen[a["replica"]] = max(seen.get(a["replica"], 0), a["active"])
out["active_after_drop"] = seen
# several models: a deployment each behind one ingress (the first app gives its CPUs back first)
serve.delete("exllama")
t1 = time.perf_counter()
serve.run(build_app({{"models": [{{"name": "a", "model_dir": TINY_A, "backend": "transformers"}},
                                 {{"name": "b", "model_dir": TINY_B, "backend": "transformers"}}],
                      "num_gpus": 0, "num_cpus": 1}}), name="multi", route_prefix="/")
out["multi_up_s"] = time.perf_counter() - t1
cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
out["multi_models"] = [[m["id"], m["state"], m["pinned"]] for m in cards]
answers = {{}}
for name in ("a", "b", "nope"):
    body = {{"model": name, "prompt": "Hello", "max_tokens": 3, "temperature": 0}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    answers[name] = [r.status_code, r.json().get("model") or r.json()["error"]["code"]]
out["multi_answers"] = answers
from exllama_integrations.langchain import ChatExLlama
chat = ChatExLlama(base_url=url, model="b", max_tokens=3, temperature=0)
out["multi_chat"] = [chat.exllama_runtime.served_model_name, chat.exllama_runtime.model_info().details["model_dir"],
                     chat.invoke("Hi").usage_metadata["output_tokens"]]
from prometheus_client.parser import text_string_to_metric_families
families = {{f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)}}
out["multi_metrics"] = sorted(s.labels["model_name"] for s in families["vllm:num_requests_running"].samples)
ss = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True).stdout.splitlines()
parent = {{}}
for d in os.listdir("/proc"):
    if d.isdigit():
        try:
            parent[int(d)] = int(open(f"/proc/{{d}}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            pass
tree, grew = {{os.getpid()}}, True
while grew:  # every process this script started: Ray's GCS, raylet, workers, replicas, proxy
    new = {{p for p, pp in parent.items() if pp in tree}} - tree
    tree |= new
    grew = bool(new)
mine = [l for l in ss if any(f"pid={{p}}," in l for p in tree)]
out["sockets"] = mine
def loopback(a):
    return a.startswith(("127.", "[::1]", "[::ffff:127."))
def ok(line):
    state, local, peer = line.split()[0], line.split()[3], line.split()[4]
    return loopback(local) and (state == "LISTEN" or loopback(peer))  # a listener's "peer" column is a wildcard
out["off_loopback"] = [l for l in mine if not ok(l)]
serve.shutdown(); ray.shutdown()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ray_run(tiny_dir, tmp_path_factory):
    from arch_models import make_arch

    root = tmp_path_factory.mktemp("ray-models")
    tiny = [make_arch(arch, root / arch, seed=i) for i, arch in enumerate(("llama3", "qwen3"))]
    return run_isolated(SCRIPT.format(model_dir=str(tiny_dir), tiny_a=str(tiny[0]), tiny_b=str(tiny[1])), timeout=600)


def test_two_replicas_stream_sixteen_clients_on_loopback(ray_run):
    out = ray_run
    print(
        f"Ray Serve, an ingress and 2 CPU model replicas, up in {out['up_s']:.1f}s; requests per replica: "
        f"{out['placement']}; a conversation's 7 turns: {out['follow_up_placement']}"
    )
    assert len(out["clients"]) == 16
    for c in out["clients"]:
        assert c["text"] == out["want"]
        assert c["chunks"] >= 5 and c["first"] < c["last"]  # streamed through the proxy, not buffered
    assert len(out["placement"]) == 2, "the two replicas did not both serve"
    assert sorted(out["follow_up_placement"].values()) == [0, 7], "a follow-up turn left the replica with its prefix"
    assert out["in_flight_after_drop"] == 0, "a dropped client's request still counts on the ingress"
    assert len(out["active_after_drop"]) == 2 and not any(out["active_after_drop"].values()), out["active_after_drop"]
    assert out["sockets"] and not out["off_loopback"], out["off_loopback"]


def test_several_models_are_a_deployment_each_behind_one_ingress(ray_run, tmp_path_factory):
    out = ray_run
    print(f"two model deployments and their ingress up in {out['multi_up_s']:.1f}s")
    assert out["multi_models"] == [["a", "loaded", True], ["b", "loaded", True]]
    assert out["multi_answers"] == {"a": [200, "a"], "b": [200, "b"], "nope": [404, "model_not_found"]}
    served, model_dir, tokens = out["multi_chat"]
    assert served == "b" and model_dir.endswith("qwen3") and tokens == 3
    assert out["multi_metrics"] == ["a", "b"]
