"""Token-in/token-out on every rollout engine: episodes run by the episode runner over ``hf``, ``vllm`` (colocated) and
``server`` (its ``hf`` and ``vllm`` backends) train on exactly the ids each engine sampled, every policy token of every
turn, with a tokenizer whose decode→encode round trip is not the identity (agent_fakes.drift_tokenizer) and a model
that samples ids it merges (agent_fakes.drift_model); and a server refuses hostile token ids in one line.

The ``vllm``-marked tests run in the vLLM venv (.ci/run) and skip without vLLM.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from agent_fakes import drift_logprobs, drift_model, drift_tokenizer

from flowkit.agents import ENVIRONMENTS, EnvStep, EpisodeOptions, EpisodeRunner, engine_generate
from flowkit.errors import ConfigError
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.rollout_engine import TokenRollouts
from flowkit.llm.server_engine import ServerRolloutEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_server_process import TOKEN, RolloutServer  # noqa: E402

HAS_VLLM = importlib.util.find_spec("vllm") is not None
VLLM = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]
TIMEOUT_S = 60.0
MAX_NEW_TOKENS = 12
VERSION = 2  # the policy version the engines sample from (the server engine pushes it)
ENVIRONMENT_TURNS = 3


class DriftChat:
    """Answers "again" to the first turns and ends the episode after :data:`ENVIRONMENT_TURNS` of them (registered
    as ``test_drift_chat`` for this module's tests only: other modules' tests list the registered names)."""

    tools = ()

    def reset(self, record):
        self.turns = 0
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, action):
        self.turns += 1
        return EnvStep([{"role": "user", "content": "again"}], reward=0.0, done=self.turns == ENVIRONMENT_TURNS)


@pytest.fixture(autouse=True)
def drift_chat(monkeypatch):
    monkeypatch.setitem(ENVIRONMENTS, "test_drift_chat", DriftChat)


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    """The drift model's directory (what vLLM and the servers load), its tokenizer and the policy."""
    directory = tmp_path_factory.mktemp("drift_model")
    tokenizer = drift_tokenizer()
    model = drift_model(tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, tokenizer, model


@contextlib.contextmanager
def drift_server(backend: str, directory: Path, log_dir: Path) -> Iterator[RolloutServer]:
    server = RolloutServer(log_dir / f"{backend}.log", TIMEOUT_S, backend, backbone=str(directory))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def hf_server(drift, tmp_path_factory):
    with drift_server("hf", drift[0], tmp_path_factory.mktemp("hf_server")) as server:
        yield server


@pytest.fixture(scope="module")
def vllm_server(drift, tmp_path_factory):
    with drift_server("vllm", drift[0], tmp_path_factory.mktemp("vllm_server")) as server:
        yield server


@pytest.fixture(params=["hf", pytest.param("vllm", marks=VLLM), "server-hf", pytest.param("server-vllm", marks=VLLM)])
def engine(request, drift):
    directory, tokenizer, model = drift
    if request.param == "hf":
        yield HFRolloutEngine(model, tokenizer, max_new_tokens=MAX_NEW_TOKENS)
        return
    if request.param == "vllm":
        from flowkit.llm.vllm_engine import VllmRolloutEngine

        colocated = VllmRolloutEngine(model, tokenizer, str(directory), max_new_tokens=MAX_NEW_TOKENS,
                                      max_model_len=256)
        yield colocated
        colocated.close()
        gc.collect()
        return
    server = request.getfixturevalue(request.param.removeprefix("server-") + "_server")
    remote = ServerRolloutEngine(model, tokenizer, server.url, timeout_s=TIMEOUT_S, max_new_tokens=MAX_NEW_TOKENS)
    yield remote
    remote.close()


def recorded(engine) -> dict[tuple[int, ...], tuple[list[int], list[float], list[int]]]:
    """What the engine's token-in path returns from now on, by the prompt it answered: the sampled ids, their
    log-probs and versions."""
    sampled = {}
    generate_from_ids = engine.generate_from_ids

    def recording(prompts, max_new_tokens, temperature=None) -> TokenRollouts:
        rollouts = generate_from_ids(prompts, max_new_tokens, temperature)
        for prompt, *row in zip(prompts, *rollouts, strict=True):
            assert tuple(prompt) not in sampled  # every prompt holds its episode's own record: none asked twice
            sampled[tuple(prompt)] = tuple(row)
        return rollouts

    engine.generate_from_ids = recording
    return sampled


def test_every_policy_token_of_every_turn_is_the_id_the_engine_sampled(engine, drift, single_thread):
    _, tokenizer, model = drift
    torch.manual_seed(0)
    engine.sync_weights(model, VERSION)
    sampled = recorded(engine)
    runner = EpisodeRunner(engine_generate(engine), tokenizer, EpisodeOptions(
        environment="test_drift_chat", max_turns=ENVIRONMENT_TURNS + 1, max_tokens=160))
    trajectories = runner.run([{"prompt": f"task {index}"} for index in range(8)])

    turns = [(trajectory, turn) for trajectory in trajectories for turn in trajectory.policy_turns()]
    assert len(turns) == len(sampled) and max(len(t.policy_turns()) for t in trajectories) == ENVIRONMENT_TURNS
    assert any(trajectory.done for trajectory in trajectories)
    expected = drift_logprobs(tokenizer)
    for trajectory, turn in turns:
        ids, logprobs, versions = sampled[trajectory.token_ids[:turn.start]]
        assert list(trajectory.token_ids[turn.start:turn.end]) == ids
        assert list(trajectory.logprobs[turn.start:turn.end]) == logprobs and versions == [VERSION] * len(ids)
        assert list(trajectory.versions[turn.start:turn.end]) == versions
        assert set(trajectory.loss_mask[turn.start:turn.end]) == {1}
        assert torch.allclose(torch.tensor(logprobs), expected[ids], atol=1e-4)  # each log-prob is its own token's
    # Bypassing the runner, re-tokenizing a turn's text trains on ids the engine never sampled.
    drifted = [ids for ids, _, _ in sampled.values()
               if tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False), add_special_tokens=False) != ids]
    assert drifted


class StringsOnly:
    """A rollout engine of one's own that takes prompt strings only."""

    tokenizer, saw_nonfinite_logits, policy_version = None, False, 0

    def generate(self, prompts, n=1, answers=None, temperature=None):
        raise AssertionError("never called")

    def sync_weights(self, model, version):
        self.policy_version = version

    def close(self):
        pass


def test_an_engine_without_a_token_in_path_is_a_one_line_error_for_episodes():
    with pytest.raises(ConfigError, match=r"^PolicyModule.rollout.engine: StringsOnly has no token-in path "
                                          r"\(generate_from_ids\), which episodes need; use engine hf, vllm or server$"):
        engine_generate(StringsOnly())


TOKEN_IN = {"prompt_ids": [[1, 5, 82]], "n": 1, "temperature": 0, "top_p": 1.0, "max_new_tokens": 4, "seed": 0,
            "min_version": 0, "wait_s": 5}
VOCAB = 116  # the drift tokenizer's, the model's embedding rows


@pytest.mark.parametrize("change, message", [
    ({"prompt_ids": [[1, -1]]}, rf"^prompt_ids\[0\]\[1\] must be a token id in \[0, {VOCAB}\), got -1$"),
    ({"prompt_ids": [[1], [VOCAB]]}, rf"^prompt_ids\[1\]\[0\] must be a token id in \[0, {VOCAB}\), got {VOCAB}$"),
    ({"prompt_ids": [[2**63]]}, r"^prompt_ids\[0\]\[0\] must be a token id in .*, got 9223372036854775808$"),
    ({"prompt_ids": [[1, True]]}, r"^prompt_ids\[0\]\[1\] must be a token id in .*, got a boolean$"),
    ({"prompt_ids": [[1.0]]}, r"^prompt_ids\[0\]\[0\] must be a token id in .*, got a number$"),
    ({"prompt_ids": [["a"]]}, r"^prompt_ids\[0\]\[0\] must be a token id in .*, got a string$"),
    ({"prompt_ids": [[]]}, r"^field 'prompt_ids' must be a non-empty list of non-empty lists of token ids$"),
    ({"prompt_ids": [1, 5]}, r"^field 'prompt_ids' must be a non-empty list of non-empty lists of token ids$"),
    ({"prompt_ids": [[1] * 600]}, r"^prompt_ids\[0\] has 600 ids: with max_new_tokens 4, over the model's context "
                                  r"of 512 tokens$"),
    ({"prompt_ids": [[1] * 100] * 1000, "n": 1000},
     r"^n × \(prompt ids \+ prompts × max_new_tokens\) = 1000 × \(100000 \+ 1000 × 4\) = 104000000 is over this "
     r"server's --max-request-tokens 16777216"),
    ({"prompts": ["task"]}, r"^the body carries both 'prompts' and 'prompt_ids': send one of them$"),
])
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=VLLM)])
def test_hostile_token_ids_are_400_in_one_line_and_the_server_serves_on(backend, change, message, request):
    server = request.getfixturevalue(f"{backend}_server")
    status, reply = generate(server, {**TOKEN_IN, **change})
    assert status == 400 and "\n" not in reply["error"] and re.search(message, reply["error"]), reply
    status, reply = generate(server, TOKEN_IN)
    assert status == 200 and len(reply["tokens"]) == 1 and "prompt_ids" not in reply


def generate(server: RolloutServer, body: dict) -> tuple[int, dict]:
    """``POST /generate`` with the session's token: its status and JSON reply, errors included."""
    request = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
