import pytest
import torch

from flowkit.explain.rectified_flow import euler_sample, noise, rectified_flow_loss


def test_euler_integrates_the_straight_field_to_a_point_exactly():
    """φ(t, z) = (c − z)/(1 − t) is linear in z and its flow is the straight line to c: Euler is exact."""
    target = torch.tensor([0.1, 0.7, 0.2])
    z0 = torch.randn(5, 3, dtype=torch.float64)
    for steps in (1, 3, 10):
        z1 = euler_sample(lambda t, z: (target - z) / (1 - t[..., None]), z0, steps)
        torch.testing.assert_close(z1, target.double().expand(5, 3), atol=1e-12, rtol=0)


def test_euler_integrates_a_constant_field_and_checks_the_time_grid():
    seen = []

    def field(t, z):
        seen.append(t[0].item())
        return torch.full_like(z, 2.0)

    z1 = euler_sample(field, torch.zeros(2, 4), 4)
    torch.testing.assert_close(z1, torch.full((2, 4), 2.0))
    assert seen == [0.0, 0.25, 0.5, 0.75]


def test_rectified_flow_loss_is_zero_for_the_true_straight_velocity_and_positive_otherwise():
    z1 = torch.softmax(torch.randn(64, 4), -1)
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(z1.shape, generator=torch.Generator().manual_seed(0))
    # With the same generator the loss draws z0 first, then t; the straight velocity z1 − z0 is exact.
    perfect = rectified_flow_loss(lambda t, z_t: z1 - z0, z1, generator=g)
    assert perfect.item() < 1e-10
    assert rectified_flow_loss(lambda t, z_t: torch.zeros_like(z_t), z1).item() > 1.0


def test_rectified_flow_loss_decreases_when_training_a_small_field():
    torch.manual_seed(0)
    z1 = torch.softmax(3 * torch.randn(1, 4), -1).expand(128, 4)
    net = torch.nn.Sequential(torch.nn.Linear(5, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(200):
        loss = rectified_flow_loss(lambda t, z: net(torch.cat((z, t[..., None]), -1)), z1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20


@pytest.mark.gpu
def test_a_cpu_generator_draws_the_same_noise_for_cuda_tensors():
    """The module's generators live on the CPU; on a GPU run the flow loss and the sampler's z0 draw there and
    move, with the same draws as a CPU run."""
    z1 = torch.softmax(torch.randn(8, 4), -1)
    seen = {}

    def recording(device):
        def velocity(t, z):
            seen[device] = (t.cpu(), z.cpu())
            return torch.zeros_like(z)
        return velocity

    for device in ("cpu", "cuda"):
        rectified_flow_loss(recording(device), z1.to(device), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(seen["cuda"], seen["cpu"])
    cuda = noise(torch.randn, (2, 3), torch.Generator().manual_seed(4), torch.device("cuda"))
    assert cuda.device.type == "cuda"
    torch.testing.assert_close(cuda.cpu(), torch.randn((2, 3), generator=torch.Generator().manual_seed(4)))
