"""The model, data and training loop shared by the DDP worker script and the tests' reference.

Worker processes place the model and data on RS_TEST_DEVICE ("cuda" in the GPU runs of the
tests); both are made on the CPU first, so every device starts from the same numbers as the
tests' reference, which runs on the CPU.
"""

import os

import torch

DEVICE = torch.device(os.environ.get("RS_TEST_DEVICE", "cpu"))

STEPS = 5
LR = 0.1
IN, HIDDEN, OUT = 8, 32, 4
PER_RANK = 6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(IN, HIDDEN)
        self.b = torch.nn.Linear(HIDDEN, HIDDEN)
        self.c = torch.nn.Linear(HIDDEN, OUT)
        # Buffers DDP broadcasts before every forward: int64 and bool (sent as bytes).
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("seen", torch.zeros(3, dtype=torch.bool))

    def forward(self, x):
        self.calls += 1
        self.seen[0] = True
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make_model(seed):
    torch.manual_seed(seed)
    with torch.device("cpu"):
        return Net().to(DEVICE)


def batch(world):
    """The whole batch: rank r trains on rows [r * PER_RANK, (r + 1) * PER_RANK)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(world * PER_RANK, IN, generator=g, device="cpu")
    y = torch.randn(world * PER_RANK, OUT, generator=g, device="cpu")
    return x.to(DEVICE), y.to(DEVICE)


def train(model, x, y, steps, momentum=0.0):
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)  # the mean over this rank's rows
        loss.backward()
        opt.step()
