"""The CUDA code paths. Tests marked `cuda` need a GPU and are skipped here, with the reason; on a GPU machine
run them with `pytest -m cuda` (docs/development.md). The unmarked tests check the CUDA branches on the CPU:
precision choice against a stand-in `torch.cuda`, pinned non-blocking copies with the copy calls recorded,
and the padding-free attention mask kept on the host.

GPU tests: a one-GPU torchrun pretraining run whose every collective and DDP go through an NCCL group (which
refuses CPU tensors, so a collective left on the CPU fails it even with one process); bf16 autocast against
fp32; model files and a resumable checkpoint written on the GPU loading on the CPU, and the reverse. Run as
a script, this file is the worker that torchrun starts (see `_worker`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import gpu, pretrain_config

import bertforge.cpu
from bertforge import BertForPreTraining
from bertforge.cli import main
from bertforge.device import to_device
from bertforge.encoder import attention_mask_for_sdpa
from bertforge.errors import BertforgeError
from bertforge.files import read_jsonl
from bertforge.train.loop import autocast, resolve_precision

SRC = Path(__file__).resolve().parents[1] / "src"
HERE = Path(__file__).resolve()


def _stand_in_gpu(monkeypatch, *, bf16: bool, name: str = "Tesla T4") -> None:
    """torch.cuda answering as one GPU with or without native bf16; nothing is allocated on it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16 or including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


# --- precision: bf16 only where the GPU has it (CPU) --------------------------------------------------------


def test_auto_precision_is_bf16_only_on_a_gpu_with_native_bf16(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    _stand_in_gpu(monkeypatch, bf16=True, name="NVIDIA A100-SXM4-40GB")
    assert [resolve_precision(p, cuda) for p in ("auto", "fp32", "bf16")] == ["bf16", "fp32", "bf16"]
    _stand_in_gpu(monkeypatch, bf16=False)  # e.g. a T4 or V100: torch would emulate bf16, slower than fp32
    assert [resolve_precision(p, cuda) for p in ("auto", "fp32")] == ["fp32", "fp32"]
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: True)  # a CPU with bf16 instructions
    assert [resolve_precision(p, cpu) for p in ("auto", "fp32", "bf16")] == ["fp32", "fp32", "bf16"]


def test_explicit_bf16_on_a_gpu_without_it_is_refused_naming_the_device(monkeypatch):
    _stand_in_gpu(monkeypatch, bf16=False)
    with pytest.raises(BertforgeError) as e:
        resolve_precision("bf16", torch.device("cuda", 0))
    assert str(e.value) == "--precision bf16: cuda:0 (Tesla T4) has no native bf16 support; use --precision fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch: no device name to ask for
    with pytest.raises(BertforgeError, match=r"cuda \(no CUDA device is available\) has no native bf16"):
        resolve_precision("bf16", torch.device("cuda"))


def test_explicit_bf16_on_a_gpu_without_it_is_an_error_line(monkeypatch, prepared, tiny_config_file, tmp_path, capsys):
    """Through the command line: one `error:` line and exit 2, before a tensor goes to the (stand-in) GPU."""
    _stand_in_gpu(monkeypatch, bf16=False)
    code = main(["pretrain", "--data", str(prepared), "--model", tiny_config_file(), "--out",
                 str(tmp_path / "run"), "--steps", "2", "--batch-size", "2", "--warmup-steps", "0", "--device", "cuda",
                 "--precision", "bf16", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines()[-1] == ("error: --precision bf16: cuda (Tesla T4) has no native bf16 support; "
                                    "use --precision fp32")


# --- host-to-device copies (CPU) ----------------------------------------------------------------------------


def test_batches_go_to_the_gpu_from_pinned_memory_without_blocking(monkeypatch):
    """Pinning and copying need a GPU, so both are recorded instead: every tensor is pinned and then copied
    with non_blocking=True, except a mask without padding, which stays on the host; on the CPU nothing moves."""
    calls: list[tuple] = []

    def pin_memory(self):
        calls.append(("pin", self.shape))
        pinned = self.clone()
        pinned.pinned = True
        return pinned

    def to(self, device, non_blocking=False):
        calls.append(("to", self.shape, getattr(self, "pinned", False), str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    cuda = torch.device("cuda", 0)
    full = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
            "nsp_labels": torch.zeros(2, dtype=torch.long), "note": "not a tensor"}
    moved = to_device(full, cuda)
    assert moved["attention_mask"] is full["attention_mask"] and moved["note"] == "not a tensor"
    assert calls == [("pin", (2, 3)), ("to", (2, 3), True, "cuda:0", True),
                     ("pin", (2,)), ("to", (2,), True, "cuda:0", True)]
    calls.clear()
    padded = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    to_device(padded, cuda)
    assert calls == [("pin", (2, 3)), ("to", (2, 3), True, "cuda:0", True),
                     ("pin", (2, 3)), ("to", (2, 3), True, "cuda:0", True)]
    calls.clear()
    assert to_device(padded, torch.device("cpu")) is padded and calls == []


# --- the attention mask (CPU) -------------------------------------------------------------------------------


def test_a_mask_without_padding_is_dropped_and_never_read_on_the_device():
    full, padded = torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert attention_mask_for_sdpa(full) is None
    assert attention_mask_for_sdpa(padded).shape == (2, 1, 1, 4)
    # A `meta` tensor stands for one on a GPU: it has no values, so reading them (a host sync on CUDA) would raise.
    on_device = attention_mask_for_sdpa(torch.ones(2, 4, dtype=torch.long, device="meta"))
    assert on_device.shape == (2, 1, 1, 4) and on_device.dtype == torch.bool
    # The loop's copy to a device leaves a padding-free mask on the host, so the model drops it there too.
    meta = torch.device("meta")
    batch = to_device({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": full}, meta)
    assert batch["input_ids"].device == meta and attention_mask_for_sdpa(batch["attention_mask"]) is None
    batch = to_device({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": padded}, meta)
    assert batch["attention_mask"].device == meta


def test_a_host_mask_without_padding_gives_the_unmasked_outputs(tiny_config):
    torch.manual_seed(0)
    model = BertForPreTraining(tiny_config).eval()
    ids = torch.randint(5, 2000, (2, 6))
    with torch.no_grad():
        a = model(ids, attention_mask=torch.ones(2, 6, dtype=torch.long)).mlm_logits
        b = model(ids).mlm_logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_pretraining_loads_with_two_workers_by_default_on_a_gpu_and_none_on_the_cpu():
    from bertforge.pretrain.run import loader_workers

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert (loader_workers(None, cuda), loader_workers(None, cpu)) == (2, 0)
    assert (loader_workers(0, cuda), loader_workers(3, cpu)) == (0, 3)  # --workers as given


# --- on a GPU -----------------------------------------------------------------------------------------------


@gpu
def test_one_gpu_torchrun_pretraining_through_an_nccl_group(prepared, tiny_config_file, tmp_path):
    job = {"data": str(prepared), "out": str(tmp_path / "run"), "model": tiny_config_file(), "backend": "nccl"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(HERE),
           json.dumps(job)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "run"
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["split"] == "eval"] == [2, 4]
    assert all(math.isfinite(r["loss"]) for r in records if r["split"] == "train")


@gpu
def test_bf16_autocast_matches_fp32(tiny_config):
    device = torch.device("cuda")
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name(device)} has no native bf16")
    torch.manual_seed(0)
    config = tiny_config.replace(hidden_size=128, num_attention_heads=4, intermediate_size=512,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(config).to(device).eval()
    B, T = 8, 48
    ids = torch.randint(5, config.vocab_size, (B, T), device=device)
    mask = (torch.arange(T, device=device) < torch.randint(T // 2, T + 1, (B, 1), device=device)).long()
    labels = torch.where((torch.rand(B, T, device=device) < 0.15) & mask.bool(), ids, -100)
    nsp = torch.randint(0, 2, (B,), device=device)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, mlm_labels=labels, nsp_labels=nsp)
        with autocast(device, resolve_precision("bf16", device)):
            low = model(ids, attention_mask=mask, mlm_labels=labels, nsp_labels=nsp)
    assert low.mlm_logits.dtype == torch.bfloat16
    # Tolerance: autocast rounds both operands of every matmul to bf16 (8-bit significand, unit roundoff
    # u = 2**-8 ~ 0.0039) and accumulates in fp32. From the embeddings to the MLM logits there are 2 layers x
    # 6 matmuls (QKV, scores, weighted values, output, FFN in and out) + 2 in the head: 14 matmuls, 28 roundings.
    # Their errors have random signs and LayerNorm rescales after each block, so they add in quadrature:
    # sqrt(28) * u ~ 0.021 of the logits' scale; bf16 autocast on the CPU, with this model and batch, measures
    # 0.005 (5 seeds). We allow 0.05, room for the GPU's other kernels (fused attention in bf16); a real fault
    # (a softmax or loss in bf16, a mask lost) moves logits by the scale itself. The loss is a mean over ~40
    # masked tokens, so its error averages down (the CPU measures 4e-5 relative): 1%.
    scale = float(ref.mlm_logits.abs().max())
    # mlm_logits: (M, V) at the M masked positions, in the same order in both runs
    torch.testing.assert_close(low.mlm_logits.float(), ref.mlm_logits, rtol=0, atol=0.05 * scale)
    assert float(low.loss) == pytest.approx(float(ref.loss), rel=0.01)


@gpu
def test_padded_attention_on_the_gpu_keeps_off_cudnn_and_gives_the_cpus_outputs(tiny_config):
    """cuDNN's attention plans every new shape for milliseconds (`encoder.CUDA_MASKED_BACKENDS`): a padded batch
    on the GPU must not reach it, and must give the CPU's outputs at its real tokens."""
    from torch.profiler import ProfilerActivity, profile

    from bertforge import BertModel

    torch.manual_seed(0)
    model = BertModel(tiny_config.replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    ids = torch.randint(5, tiny_config.vocab_size, (4, 37))
    mask = (torch.arange(37) < torch.tensor([[37], [20], [9], [30]])).long()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).sequence_output
        gpu_model = model.to("cuda", torch.bfloat16)  # cuDNN's kernel takes bf16 and fp16 only
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = gpu_model(ids.cuda(), attention_mask=mask.cuda()).sequence_output.float().cpu()
    assert not [e.key for e in prof.key_averages() if "cudnn_attention" in e.key]
    real = mask.bool()
    # bf16 weights and activations through 2 layers, LayerNorm's outputs of scale ~1: the same model in bf16 on the
    # CPU is off by 0.037 at most; a lost mask moves outputs by their scale
    torch.testing.assert_close(out[real], ref[real], rtol=0, atol=0.1)


@gpu
def test_model_files_written_on_the_gpu_load_on_the_cpu_and_back(tiny_config, tmp_path):
    torch.manual_seed(0)
    on_gpu = BertForPreTraining(tiny_config).to("cuda")
    on_gpu.save_pretrained(tmp_path / "gpu")
    loaded = BertForPreTraining.from_pretrained(tmp_path / "gpu", verbose=False)
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    want = {k: v.cpu() for k, v in on_gpu.state_dict().items()}
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]), k
    loaded.save_pretrained(tmp_path / "cpu")
    back = BertForPreTraining.from_pretrained(tmp_path / "cpu", verbose=False).to("cuda")
    for k, v in back.state_dict().items():
        assert torch.equal(v.cpu(), want[k]), k


@gpu
@pytest.mark.parametrize(("first", "then"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_resumes_on_the_other_device(prepared, tiny_config_file, tmp_path, first, then):
    """Four steps on one device with a checkpoint at step 2; a copy of what a run killed after that checkpoint
    leaves resumes on the other device: the weights, optimizer state and RNG states written on one load on the
    other, and (without dropout, so no device's random stream matters) the last two losses match the
    uninterrupted run's to the devices' float differences."""
    cfg = tiny_config_file(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = ["pretrain", "--data", str(prepared), "--model", cfg, "--batch-size", "4", "--steps", "4",
            "--warmup-steps", "1", "--save-every", "2", "--eval-batches", "1", "--log-every", "1",
            "--precision", "fp32", "--no-progress"]
    assert main([*args, "--out", str(full), "--device", first]) == 0
    shutil.copytree(full / "checkpoints" / "step-2", cut / "checkpoints" / "step-2")
    shutil.copy(full / "run_config.json", cut / "run_config.json")
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(full / "metrics.jsonl")
                                               if r["step"] <= 2))
    assert main([*args, "--out", str(cut), "--device", then, "--resume"]) == 0
    losses = [[r["loss"] for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "train"] for run in (full, cut)]
    assert len(losses[0]) == len(losses[1]) == 4
    assert losses[1][2:] == pytest.approx(losses[0][2:], rel=1e-4)
    assert (cut / "model.safetensors").is_file()


def _worker(job: dict) -> None:
    """The one rank of the torchrun test. With one process `distributed.setup` makes no process group, so the
    worker makes one (NCCL on the GPU) and has the package use it: the loop's collectives, DDP and the
    checkpoint's RNG gathering all run through it, as they do with several GPUs."""
    import torch.distributed as dist

    from bertforge.options import DataOptions
    from bertforge.pretrain.run import pretrain
    from bertforge.train import distributed
    from bertforge.train.loop import LoopOptions

    nccl = job["backend"] == "nccl"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group(backend=job["backend"])
    distributed.setup = lambda requested=None: distributed.Dist(rank=0, world_size=1, local_rank=0, device=device)
    distributed.Dist.enabled = property(lambda self: dist.is_initialized())
    loop = LoopOptions(steps=4, batch_size=8, lr=1e-3, warmup_steps=1, eval_every=2, save_every=2, log_every=1,
                      progress=False, device=str(device))
    pretrain(pretrain_config(job["data"], job["out"], model=job["model"], loop=loop,
                             data_options=DataOptions(eval_batches=2)))


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
