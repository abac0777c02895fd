"""A round's flow data gathered over ranks (flowkit.explain.flow_data): two gloo ranks each explain a disjoint
share of the round; every rank's flow then trains on the union, and its data, losses and weights equal one
rank's over the whole round. The ranks are two processes of this file run as a script."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from flowkit.explain.flow_data import accepted_flow_data, fit_flow, gather_flow_data
from flowkit.explain.prompts import explanation_prompt
from flowkit.explain.reward_model import ExplanationFlowModel, explanation_inputs
from flowkit.llm.packing import encode_pairs
from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:=?+-[]!\n"
CONTEXTS, PER_CONTEXT, PROXIES, DECISIONS = 6, 2, 2, 4
WORLD = 2


def round_targets() -> tuple[torch.Tensor, torch.Tensor]:
    """Proxy targets [K_p, B, |A|] and acceptances [K_p, B] of the whole round's B = CONTEXTS × PER_CONTEXT
    explanations; some explanations no proxy accepts, and the ranks accept different numbers."""
    generator = torch.Generator().manual_seed(5)
    targets = torch.randn(PROXIES, CONTEXTS * PER_CONTEXT, DECISIONS, generator=generator).softmax(-1)
    kept = torch.rand(PROXIES, CONTEXTS * PER_CONTEXT, generator=generator) < 0.5
    return targets, kept


def round_data(rank: int, world: int):
    """This rank's flow data, built the way ExplanationPolicyModule builds them: its share of the contexts
    (every world-th), PER_CONTEXT explanations each, row ids c·n + j; explanations of different lengths, so
    the ranks' K/V differ in length."""
    tokenizer = char_tokenizer(ALPHABET)
    torch.manual_seed(0)
    backbone = tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=128).eval().requires_grad_(False)
    torch.manual_seed(1)
    reward_model = ExplanationFlowModel(DECISIONS, 64, num_steps=2, num_draws=2, time_dim=8, projector_dim=16,
                                   encode_batch_size=3)
    contexts = torch.arange(rank, CONTEXTS // world * world, world)
    row_ids = (contexts[:, None] * PER_CONTEXT + torch.arange(PER_CONTEXT)).flatten()
    prompts = [explanation_prompt(f"d=+{c},-1 a=?") for c in contexts.tolist() for _ in range(PER_CONTEXT)]
    responses = ["goal is east. " * (1 + int(row) % 5) for row in row_ids]
    inputs = explanation_inputs(encode_pairs(tokenizer, prompts, responses), tokenizer)
    targets, kept = round_targets()
    data = accepted_flow_data(reward_model, backbone, inputs, targets[:, row_ids], kept[:, row_ids], row_ids)
    return reward_model, data


def train(reward_model: ExplanationFlowModel, data) -> list[float]:
    """Two flow epochs on ``data`` with plain Adam: no gradient averaging, so equal weights across ranks
    come from equal data and noise alone."""
    optimizer = torch.optim.Adam(reward_model.parameters(), lr=1e-2)

    def step(loss):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    losses = fit_flow(reward_model, data, epochs=2, batch_size=4, generator=torch.Generator().manual_seed(3),
                      step=step)
    return [float(x) for x in losses]


def record(reward_model, local, union, losses) -> dict:
    return {"local_rows": local.row_ids, "row_ids": union.row_ids, "kept": union.kept, "targets": union.targets,
            "keys": union.context.keys, "values": union.context.values, "lengths": union.context.lengths,
            "pairs": torch.stack(union.pairs()), "losses": losses, "weights": reward_model.state_dict()}


def rank_main(out: Path) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    reward_model, local = round_data(rank, world)
    union = gather_flow_data(local)
    torch.save(record(reward_model, local, union, train(reward_model, union)), out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(out: Path) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(WORLD),
           "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen([sys.executable, __file__, str(out)], env={**env, "RANK": str(rank)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(WORLD)]
    try:
        logs = [process.communicate(timeout=120)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert all(process.returncode == 0 for process in processes), "\n".join(log[-3000:] for log in logs)
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


def valid(kv: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``kv`` [R, Hkv, N, dh] with the positions past each row's length zeroed: there the backbone pass leaves
    whatever its micro-batch's padding gave, which the flow never reads."""
    return kv * (torch.arange(kv.shape[2]) < lengths[:, None])[:, None, :, None]


def test_two_ranks_train_their_flows_on_the_union_as_one_rank_on_the_whole_round(tmp_path):
    ranks = _run_ranks(tmp_path)
    reward_model, local = round_data(0, 1)  # one rank, the whole round, no process group
    initial = {name: weight.clone() for name, weight in reward_model.state_dict().items()}
    union = gather_flow_data(local)
    single = record(reward_model, local, union, train(reward_model, union))

    shares = [set(r["local_rows"].tolist()) for r in ranks]
    assert shares[0] and shares[1] and not shares[0] & shares[1]  # disjoint, each accepted some
    assert len(shares[0]) != len(shares[1])  # the ranks contribute different numbers of explanations
    assert shares[0] | shares[1] == set(single["row_ids"].tolist())  # nothing lost, nothing repeated
    for rank in ranks:
        # Gathered in rank order, the union holds one rank's data row for row once ordered by row id.
        order = rank["row_ids"].argsort()
        for name in ("row_ids", "kept", "targets", "lengths"):
            assert torch.equal(rank[name][order], single[name]), name
        for name in ("keys", "values"):  # padded to the longest explanation of any rank, as one rank holds them
            lengths = single["lengths"]
            torch.testing.assert_close(valid(rank[name][order], lengths), valid(single[name], lengths), msg=name)
        assert torch.equal(rank["row_ids"][rank["pairs"][0]], single["row_ids"][single["pairs"][0]])
        assert torch.equal(rank["pairs"][1], single["pairs"][1])  # the same pair sequence
        assert rank["losses"] == ranks[0]["losses"] and len(rank["losses"]) > 2
    assert any(not torch.equal(weight, initial[name]) for name, weight in ranks[0]["weights"].items())
    for name, weight in ranks[0]["weights"].items():
        torch.testing.assert_close(ranks[1]["weights"][name], weight, rtol=0, atol=0, msg=name)  # identical updates
        torch.testing.assert_close(weight, single["weights"][name], msg=name)  # as one rank over the whole round
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]))


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
