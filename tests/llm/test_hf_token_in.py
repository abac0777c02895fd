"""The hf engine's token-in path: token ids in; the sampled ids, their sampler log-probs and policy versions out."""

import torch

from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine


def test_token_ids_in_give_what_the_string_path_samples_cut_at_each_rows_limit(single_thread):
    model, tokenizer = load_backbone("bundled:tiny_adder")
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=16, temperature=0.0)
    prompts = ["47+38=", "123+456="]
    batch = engine.generate(prompts)
    expected = [batch.input_ids[row][batch.response_mask[row].bool()].tolist() for row in range(2)]
    ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]  # different lengths: left-padded together
    engine.policy_version = 4
    samples, logprobs, versions = engine.generate_from_ids(ids, [16, 16])
    assert samples == expected and versions == [[4] * len(sample) for sample in samples]
    assert [len(row) for row in logprobs] == [len(sample) for sample in samples]
    assert all(p <= 0 for row in logprobs for p in row)
    cut, cut_logprobs, _ = engine.generate_from_ids(ids, [3, 100])  # a row's own room; the engine's bound above it
    assert cut == [expected[0][:3], expected[1]]
    assert torch.tensor(cut_logprobs[0]).allclose(torch.tensor(logprobs[0][:3]))
    assert torch.tensor(cut_logprobs[1]).allclose(torch.tensor(logprobs[1]))
