"""The engine with its target on RPC workers (`session.open_decoder(..., rpc=...)`, `--rpc`): the same
greedy tokens as a local run, placement in the stats, a bad endpoint refused before loading."""
import pytest

from ggufspec import GgufspecError
from ggufspec.session import open_decoder
from rpcworkers import Worker


@pytest.fixture(scope="module")
def two_workers(needs_rpc, tmp_path_factory):
    logs = tmp_path_factory.mktemp("rpc-decoder")
    started = [Worker(logs), Worker(logs)]
    yield started
    for worker in started:
        worker.stop()


def test_target_on_two_workers_gives_the_local_tokens(tiny_pair, tiny_decoder, two_workers):
    target, draft = tiny_pair
    endpoints = ",".join(str(w.endpoint) for w in two_workers)
    prompt = [1, 260, 261, 262]
    with open_decoder(target, draft, n_ctx=256, n_threads=1, rpc=endpoints) as remote:
        for k in (0, 3):
            got = remote.generate(prompt, n_predict=24, n_draft=k)
            local = tiny_decoder.generate(prompt, n_predict=24, n_draft=k)
            assert got.tokens == local.tokens
        placement = got.stats.placement
        assert set(placement) >= {str(w.endpoint) for w in two_workers}
        assert sum(placement.values()) == 3  # the tiny target's 2 blocks and its output layer
        assert "target layers:" in got.stats.llamacpp_block()


def test_unreachable_worker_is_one_line_before_loading(tiny_pair, needs_rpc):
    with pytest.raises(GgufspecError, match="127.0.0.1:9"):
        open_decoder(tiny_pair[0], tiny_pair[1], rpc="127.0.0.1:9")


def test_bad_endpoint_is_one_line(tiny_pair):
    with pytest.raises(GgufspecError):
        open_decoder(tiny_pair[0], tiny_pair[1], rpc="nohostport")


def test_cli_worker_and_run_with_rpc(tiny_pair, needs_rpc, tmp_path):
    """`ggufspec worker` as a process, `ggufspec run --rpc` against it: the same text as a local run."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from ggufspec import rpc
    from rpcworkers import free_port

    exe = str(Path(sys.executable).with_name("ggufspec"))
    port = free_port()
    worker = subprocess.Popen([exe, "worker", "--port", str(port), "-t", "1"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                rpc.probe(f"127.0.0.1:{port}", timeout=1)
                break
            except rpc.RpcError:
                assert time.monotonic() < deadline and worker.poll() is None, "worker did not start"
                time.sleep(0.2)
        target, draft = tiny_pair
        common = [exe, "run", "-m", str(target), "-md", str(draft), "-p", "the cat", "-n", "16", "--draft", "3",
                  "-t", "1", "--json"]
        local = subprocess.run(common, capture_output=True, text=True, timeout=60)
        remote = subprocess.run(common + ["--rpc", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
        assert remote.returncode == 0, remote.stderr
        got, expected = json.loads(remote.stdout), json.loads(local.stdout)
        assert got["tokens"] == expected["tokens"]
        assert f"127.0.0.1:{port}" in got["stats"]["placement"]
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
    import socket
    with socket.socket() as busy:  # a port in use: the worker warns about the address, then refuses at once
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        warning = subprocess.run([exe, "worker", "--host", "0.0.0.0", "--port", str(busy.getsockname()[1])],
                                 capture_output=True, text=True, timeout=30, env={**os.environ})
    assert "unauthenticated" in warning.stderr.lower(), warning.stderr
    assert warning.returncode != 0


def test_plan_splits_a_70b_target_across_two_declared_hosts(tmp_path):
    """The seed-001 pair's target (Llama-3-70B Q3_K_S shape) across two 24 GiB hosts, declared with
    --rpc-mem so no worker is contacted: every block on the workers, none left on this CPU."""
    import json

    from click.testing import CliRunner

    from ggufspec.cli import main
    from ggufspec.tinymodels import write_header_only

    target = write_header_only(tmp_path / "llama3-70b-q3_k_s.gguf", n_layer=80, n_embd=8192, n_head=64,
                               n_head_kv=8, n_ff=28672, n_vocab=128256)
    hosts = ["10.0.0.2:50052", "10.0.0.3:50052"]
    result = CliRunner().invoke(main, ["plan", "-m", str(target), "--rpc", ",".join(hosts), "-c", "4096",
                                       "--rpc-mem", f"{hosts[0]}=24GiB", "--rpc-mem", f"{hosts[1]}=24GiB", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    shares = {h["host"]: h for h in plan["hosts"]}
    assert plan["ngl"] == 81 and shares["CPU"]["blocks"] == 0
    assert [shares[h]["blocks"] for h in hosts] == plan["tensor_split"] and sum(plan["tensor_split"]) == 81
    assert all(shares[h]["bytes"] <= 24 * 2**30 for h in hosts)
    # one 24 GiB host cannot hold it: the rest stays on this machine's CPU
    one = json.loads(CliRunner().invoke(main, ["plan", "-m", str(target), "--rpc", hosts[0], "-c", "4096",
                                               "--rpc-mem", f"{hosts[0]}=24GiB", "--json"]).output)
    assert 0 < one["ngl"] < 81 and {h["host"]: h["blocks"] for h in one["hosts"]}["CPU"] == 81 - one["ngl"]


def test_rpc_mem_bad_input_is_one_line(tmp_path, tiny_pair):
    from click.testing import CliRunner

    from ggufspec.cli import main
    result = CliRunner().invoke(main, ["plan", "-m", str(tiny_pair[0]), "--rpc", "10.0.0.2:50052",
                                       "--rpc-mem", "10.0.0.2:50052"])
    assert result.exit_code == 2 and "--rpc-mem takes HOST:PORT=SIZE" in result.output


def test_ngl_0_keeps_every_layer_here_and_a_bad_split_is_one_line(tiny_pair, two_workers):
    """-ngl 0 with --rpc: every layer on this machine (0 was read as "not given", and all went to the
    workers, however small); a tensor_split with more shares than devices, or a negative one, is refused."""
    from ggufspec.session import ModelOptions, open_session
    target, draft = tiny_pair
    endpoints = ",".join(str(w.endpoint) for w in two_workers)
    options = ModelOptions(model=str(target), model_draft=str(draft), n_ctx=256, n_threads=1, rpc=endpoints,
                           n_gpu_layers=0)
    with open_session(options, log=lambda line: None) as session:
        assert set(session.decoder.placement) == {"CPU"}
    for split in ([1, 1, 1], [1, float("nan")], [-1, 1]):
        with pytest.raises(GgufspecError, match="tensor_split: give at most 2 shares"):
            open_decoder(target, draft, n_ctx=256, n_threads=1, rpc=endpoints, tensor_split=split)


def test_an_empty_rpc_list_is_refused_not_a_local_run(tiny_pair):
    from ggufspec.session import ModelOptions, open_session
    with pytest.raises(GgufspecError, match="no empty entries"):
        open_session(ModelOptions(model=str(tiny_pair[0]), n_ctx=256, rpc=""), log=lambda line: None)
