"""lora.py: LoRA through PEFT. The trainer trains an adapter on a frozen base; only the adapter travels
to the engines (weight_sync.py) and into checkpoints; the engines serve base + adapter (vLLM's LoRA).

    torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1 --lora-rank 8     # LoRA RL
    python -m lora merge BASE_DIR ADAPTER_DIR OUT_DIR     # base + adapter -> a full HF model dir

The adapter's tensors carry PEFT's names ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
the names vLLM's LoRA loader reads. Every engine holds one adapter, ADAPTER_ID; each weight sync
replaces its tensors in place (WeightSyncWorker), and every request names it (vllm_engine.VLLMEngine).
Deviation: dropout > 0 makes the trainer's logprobs differ from the engine's (which has none), so the
default is 0.
"""

import json
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

from config import opt

ADAPTER_NAME, ADAPTER_ID = "policy", 1   # the one adapter each engine serves (vLLM's ids start at 1)
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"   # attention and MLP projections


@dataclass
class LoraConfig:
    """LoRA's settings (rank 0: full fine-tuning)."""
    lora_rank: int = opt(0, "LoRA: train a rank-R adapter (PEFT) instead of every weight; only the adapter "
                            "is synced and checkpointed; 0 = full fine-tuning")
    lora_alpha: float = opt(0.0, "LoRA: the adapter's scale is alpha / rank; 0 = 2 x --lora-rank")
    lora_targets: str = opt(TARGETS, "LoRA: comma-separated module names the adapter wraps")
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapter's input while training (keep 0 for RL: "
                                   "the engine has none, so > 0 puts trainer and engine logprobs apart)")

    def __post_init__(self):
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.lora_alpha < 0:
            raise ValueError(f"--lora-alpha must be >= 0 (0 = 2 x --lora-rank), got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_rank and not self.targets:
            raise ValueError("--lora-targets: empty; name the modules to adapt, e.g. " + TARGETS)

    @property
    def targets(self) -> list[str]:
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]

    def adapter_config(self, base: str) -> dict:
        """adapter_config.json's content (PEFT's format; vLLM and PeftModel.from_pretrained read it)."""
        d = self.peft_config().to_dict()
        d["target_modules"] = sorted(d["target_modules"])    # (a set in PEFT)
        d["base_model_name_or_path"] = base
        return d

    def peft_config(self):
        from peft import LoraConfig as PeftLoraConfig
        return PeftLoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha or 2 * self.lora_rank,
                              target_modules=self.targets, lora_dropout=self.lora_dropout, bias="none",
                              task_type="CAUSAL_LM")


def check_lora(cfg: LoraConfig, model_dir: str):
    """Before anything starts: the targets exist in the model, the rank fits each of their weights,
    and vLLM can serve LoRA for the architecture. Raises ValueError naming the flag."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):                         # shapes only: no memory, no weights read
        model = AutoModelForCausalLM.from_config(hf)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for target in cfg.targets:
        found = [m for n, m in linears.items() if n.split(".")[-1] == target]
        if not found:
            names = sorted({n.split(".")[-1] for n in linears})
            raise ValueError(f"--lora-targets: {target!r} is no linear module of {model_dir} (it has: "
                             f"{', '.join(names)})")
        dim = min(min(m.in_features, m.out_features) for m in found)
        if cfg.lora_rank > dim:
            raise ValueError(f"--lora-rank {cfg.lora_rank} exceeds {target}'s smaller dimension ({dim}) in "
                             f"{model_dir}")
    engine_rank(cfg.lora_rank)
    from vllm import ModelRegistry
    from vllm.model_executor.models import supports_lora
    for arch in hf.architectures or []:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None and not supports_lora(cls):
            raise ValueError(f"--lora-rank: vLLM cannot serve LoRA adapters for {arch} ({model_dir})")


def engine_rank(rank: int) -> int:
    """vLLM's max_lora_rank for an adapter of this rank: the smallest it accepts that fits."""
    from vllm.config.lora import MaxLoRARanks
    ranks = typing.get_args(MaxLoRARanks)
    fits = [r for r in ranks if r >= rank]
    if not fits:
        raise ValueError(f"--lora-rank {rank}: vLLM serves adapters of rank <= {max(ranks)}")
    return min(fits)


def wrap(model, cfg: LoraConfig):
    """The model with cfg's adapter (B = 0: it starts as the base model); only the adapter trains."""
    from peft import get_peft_model
    return get_peft_model(model, cfg.peft_config(), adapter_name="default")


def is_adapter_tensor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_name(name: str) -> str:
    """A wrapped model's state_dict name -> PEFT's saved name (without the adapter's own name)."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def load_adapter(model, adapter_dir):
    """Set a wrap()ped model's adapter to the one saved in adapter_dir (save_adapter's, or PEFT's)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{adapter_dir}: no adapter_model.safetensors (not a LoRA checkpoint)")
    result = set_peft_model_state_dict(model, load_file(str(path)))
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{path}: tensors this model's adapter does not have (another --lora-targets?): "
                         f"{result.unexpected_keys[:3]}")


def save_adapter(out_dir, named, cfg: LoraConfig, base: str):
    """Write (name, tensor) adapter pairs as a PEFT adapter dir: adapter_config.json +
    adapter_model.safetensors."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in named}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(cfg.adapter_config(base), indent=2))


def merge(base_dir: str, adapter_dir: str, out_dir: str):
    """base + adapter -> a full HF model dir (weights, config, tokenizer) that vLLM and transformers load."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "merge":
        sys.exit("usage: python -m lora merge BASE_DIR ADAPTER_DIR OUT_DIR")
    for what, path in (("BASE_DIR", sys.argv[2]), ("ADAPTER_DIR", sys.argv[3])):
        if not Path(path).is_dir():
            sys.exit(f"lora merge: {what} {path}: no such directory")
    if not (Path(sys.argv[3]) / "adapter_config.json").exists():
        sys.exit(f"lora merge: ADAPTER_DIR {sys.argv[3]}: no adapter_config.json (not a PEFT adapter dir)")
    merge(*sys.argv[2:])
    print(f"lora merge: {sys.argv[2]} + {sys.argv[3]} -> {sys.argv[4]}")
