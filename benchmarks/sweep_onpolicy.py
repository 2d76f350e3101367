"""Synchronous on-policy loop (GRPO by default) without the bus, for tuning learning settings
quickly.

Each step samples `--groups` prompts x `--n` responses with the HF engine, trains one learner
step, hot-loads the adapter into the engine, and every 20 steps measures held-out greedy
accuracy on 500 problems. Prints the settings, the time (evaluation excluded) and the curve as
(step, accuracy, training reward). Example:

    python benchmarks/sweep_onpolicy.py --model ~/.cache/miles/demo/sft-<key> --lr 1e-3 --steps 100

`--algo` picks an algorithm preset (`miles algorithms` lists them); `--task` a built-in task
(`arithmetic`: reversed answers, `arithmetic-plain`) or a JSONL prompt file.
"""
import asyncio, time, torch, numpy as np, random
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.trainer.learner import Learner, LearnerConfig
from miles.config import build
from miles.rl.algorithm import AlgorithmConfig, preset
from miles.rl.sampling import SamplingParams
from miles.tasks.datasets import load_problems
from miles.protocol import TrajectoryGroup, Sample
from miles.evaluation import greedy_accuracy
import argparse
import tempfile
ADAPTER_DIR = tempfile.mkdtemp(prefix="miles-sweep-")
ap=argparse.ArgumentParser(); ap.add_argument("--model", required=True); ap.add_argument("--lr", type=float, default=2e-3)
ap.add_argument("--groups", type=int, default=32); ap.add_argument("--n", type=int, default=8); ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--temp", type=float, default=1.0); ap.add_argument("--r", type=int, default=16); ap.add_argument("--alpha", type=int, default=32)
ap.add_argument("--algo", default="grpo"); ap.add_argument("--task", default="arithmetic"); ap.add_argument("--beta2", type=float, default=0.999)
a=ap.parse_args()
torch.set_num_threads(2)
lora=LoraSettings(r=a.r, alpha=a.alpha)
eng=HFEngine(a.model, lora=lora)
L=Learner(a.model, LearnerConfig(lr=a.lr, betas=(0.9,a.beta2), algorithm=build(AlgorithmConfig, preset(a.algo))), lora=lora)
train=load_problems(a.task, "train"); random.Random(0).shuffle(train)
test=load_problems(a.task, "test")[:500]
sp=SamplingParams(n=a.n, temperature=a.temp, max_new_tokens=5)
t0=time.time(); acc=[(0, round(asyncio.run(greedy_accuracy(eng,test)),3))]; ev=0
for step in range(a.steps):
    probs=train[step*a.groups:(step+1)*a.groups]
    outs=eng.generate([eng.encode(p.prompt) for p in probs], sp, seed=step)
    groups=[]
    for i,(p,cs) in enumerate(zip(probs,outs)):
        samples=[]
        for c in cs:
            ids=c.token_ids; txt=eng.decode(ids[:-1] if c.finish_reason=="stop" else ids)
            samples.append(Sample(response_token_ids=ids, logprobs=c.logprobs, versions=np.full(len(ids),L.policy_version,dtype=np.int32), reward=float(txt.strip()==p.answer), finish_reason=c.finish_reason))
        groups.append(TrajectoryGroup(group_id=str(i), task_id=str(i), prompt_token_ids=np.array(eng.encode(p.prompt),dtype=np.int32), samples=samples, producer_id="p", engine="hf", vocab_size=eng.vocab_size, sampling=sp.as_wire(), created_at=0.0))
    m=L.train_step(groups)
    L.export_weights(ADAPTER_DIR); eng.load_adapter(ADAPTER_DIR, L.policy_version)
    if (step+1)%20==0:
        t=time.time(); acc.append((step+1, round(asyncio.run(greedy_accuracy(eng,test)),3), round(m["trainer/reward_mean"],3))); ev+=time.time()-t
print(vars(a), "time", round(time.time()-t0-ev,1), acc, flush=True)
