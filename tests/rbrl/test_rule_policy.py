import torch

from flowkit.rbrl.policy import RuleAttentionNetwork, masked_log_softmax


def _net(**kw):
    torch.manual_seed(0)
    return RuleAttentionNetwork(state_dim=5, embed_dim=12, hidden=8, num_layers=3, **kw).eval()


def test_permutation_equivariant_over_rules():
    net = _net(heads=2)
    state, rules = torch.randn(3, 5), torch.randn(3, 6, 12)
    mask = torch.ones(3, 6, dtype=torch.bool)
    perm = torch.randperm(6)
    out = net(state, rules, mask)
    torch.testing.assert_close(net(state, rules[:, perm], mask), out[:, perm])


def test_padding_does_not_change_real_rules_outputs():
    net = _net()
    state, rules = torch.randn(1, 5), torch.randn(1, 3, 12)
    alone = net(state, rules, torch.ones(1, 3, dtype=torch.bool))
    padded = torch.cat([rules, 100 * torch.randn(1, 4, 12)], dim=1)  # garbage in the padding
    mask = torch.tensor([[True, True, True, False, False, False, False]])
    out = net(state, padded, mask)
    torch.testing.assert_close(out[:, :3], alone)
    assert (out[:, 3:] == 0).all()
    log_pi = masked_log_softmax(out, mask)
    assert torch.isneginf(log_pi[:, 3:]).all()
    torch.testing.assert_close(log_pi[:, :3].exp().sum(-1), torch.ones(1))


def test_variable_rule_counts_in_one_batch():
    net = _net()
    state = torch.randn(2, 5)
    a, b = torch.randn(2, 12), torch.randn(5, 12)
    batch = torch.zeros(2, 5, 12)
    batch[0, :2], batch[1] = a, b
    mask = torch.tensor([[True, True, False, False, False], [True] * 5])
    out = net(state, batch, mask)
    torch.testing.assert_close(out[0, :2], net(state[:1], a[None], mask[:1, :2])[0])
    torch.testing.assert_close(out[1], net(state[1:], b[None], mask[1:])[0])


def test_output_depends_on_state_and_rule_content():
    net = _net()
    rules = torch.randn(1, 4, 12)
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = net(torch.randn(1, 5), rules, mask)
    assert not torch.allclose(out, net(torch.randn(1, 5), rules, mask))
    assert not torch.allclose(out[0, 0], out[0, 1])
