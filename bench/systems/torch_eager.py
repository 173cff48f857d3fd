"""torch-eager: PyTorch eager mode on the same weights and batches, torch.optim.Adam,
loss.item() every step, 2 threads. Skips cleanly where torch is not installed."""

import common

try:
    import torch
    import torch.nn.functional as F
except ImportError as error:
    common.unavailable(f"torch not importable ({error}); pip install torch==2.13.0")


def mlp(p, x):
    return torch.relu(x @ p["W1"] + p["B1"]) @ p["W2"] + p["B2"]


def cnn(p, x):
    h = F.max_pool2d(torch.relu(F.conv2d(x, p["C1"], p["c1"], padding=1)), 2)
    h = F.max_pool2d(torch.relu(F.conv2d(h, p["C2"], p["c2"], padding=1)), 2)
    return h.flatten(1) @ p["W"] + p["B"]


def transformer(p, x, heads=2):
    batch, seq, d = x.shape

    def split(name):
        return (x @ p[f"W{name}"] + p[f"b{name}"]).view(batch, seq, heads, d // heads).transpose(1, 2)

    attention = torch.softmax(split("q") @ split("k").transpose(2, 3) / (d // heads) ** 0.5, dim=-1)
    context = (attention @ split("v")).transpose(1, 2).reshape(batch, seq, d)
    h1 = F.layer_norm(x + context @ p["Wo"] + p["bo"], (d,), p["ln1_g"], p["ln1_b"], 1e-5)
    ffn = torch.relu(h1 @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]
    h2 = F.layer_norm(h1 + ffn, (d,), p["ln2_g"], p["ln2_b"], 1e-5)
    return h2.mean(1) @ p["Wc"] + p["bc"]


task = common.job()
torch.set_num_threads(2)
forward = {"mlp": mlp, "cnn": cnn, "transformer": transformer}[task["model"]]
params = {name: torch.tensor(value, requires_grad=True) for name, value in common.weights(task).items()}
optimizer = torch.optim.Adam(params.values(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
data = [{name: torch.from_numpy(value) for name, value in batch.items()} for batch in common.batches(task)]


def step(batch):
    optimizer.zero_grad()
    loss = F.cross_entropy(forward(params, batch["x"]), batch["labels"])
    loss.backward()
    optimizer.step()
    return loss.item()


common.report(**common.time_steps(step, data, task), versions=common.versions("torch"))
