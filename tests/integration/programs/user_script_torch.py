"""A plain Horovod PyTorch script, as a user would write it: hvdtrain runs it unchanged."""

import argparse
import json
import sys

import horovod.torch as hvd
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--tag", default="")
args = parser.parse_args()

hvd.init()
torch.manual_seed(hvd.rank())  # deliberately different inits: the broadcast must make them equal
model = torch.nn.Linear(4, 2)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for _ in range(args.epochs):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
weights = hvd.allgather(model.weight.detach().reshape(1, -1))
print(
    json.dumps(
        {
            "rank": hvd.rank(),
            "argv": sys.argv[1:],
            "epochs": args.epochs,
            "equal": bool(torch.equal(weights[0], weights[-1])),
        }
    )
)
