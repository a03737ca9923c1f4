import sys

import torch
from torch import nn

import comera_compile as cc

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400  # python quickstart.py [steps]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 10))                       # your model, any nn.Module
x = torch.randn(8192, 256)                                      # your data: a teacher's labels
y = nn.Sequential(nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 10))(x).argmax(1).detach()

small = cc.optimize(model, budget=0.1, example_inputs=(x[:64],), compile=False)
print(cc.summary(small))
optimizer = torch.optim.AdamW(cc.training.param_groups(small, lr=3e-3))
trainer = cc.training.RankAdaptiveTrainer(small, optimizer, target_ratio=0.5, total_steps=steps)
for _ in range(steps):
    i = torch.randint(0, 7168, (128,))
    loss = trainer.loss(nn.functional.cross_entropy(small(x[i]), y[i]))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    trainer.step()  # early stage: rank gates shrink; late stage: channels are cut out
accuracy = (small(x[7168:]).argmax(1) == y[7168:]).float().mean().item()
print(f"held-out accuracy {accuracy:.1%}; parameters {sum(p.numel() for p in model.parameters()):,}"
      f" -> {sum(p.numel() for p in small.parameters()):,}")
