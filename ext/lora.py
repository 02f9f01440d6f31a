"""ext/lora.py: LoRA through PEFT (--lora-rank). The trainer trains an adapter on a frozen base; only the
adapter travels to the engines and into checkpoints; the engines serve base + adapter (vLLM's LoRA).

    torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1 --lora-rank 8     # LoRA RL
    python -m ext.lora merge BASE_DIR ADAPTER_DIR OUT_DIR     # base + adapter -> a full HF model dir

The seams: trainer.Weights (LoraWeights: what trains, travels and is saved; switchable, so --kl-coef's
reference is the base with the adapter off, no copy), the engine's `load` (the workers put what they
receive into the adapter, load_into_engine) and request keywords (every request names the adapter), the
engine's start keywords (enable_lora). The adapter's tensors carry PEFT's names
("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), the names vLLM's LoRA loader reads.
Every engine holds one adapter, ADAPTER_ID; each weight sync replaces its tensors in place. A resumed run
starts from the base model plus the checkpoint's adapter, and must keep its --lora-rank.
Deviation: dropout > 0 makes the trainer's logprobs differ from the engine's (which has none), so the
default is 0.
"""

import json
import math
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Extension, extension, opt
from trainer import Weights

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


def set_adapter(model, adapter_dir: str, seed: int):
    """A LoRA model's adapter starting values, the same on one rank or many: the saved adapter (a
    --resume), else PEFT's init (A kaiming-uniform, B = 0) drawn from a generator seeded by `seed`. Under
    FSDP each rank keeps its own shard of each (small) full tensor."""
    from torch.distributed.tensor import distribute_tensor
    params = {n: p for n, p in model.named_parameters() if is_adapter_tensor(n)}
    if adapter_dir:
        from safetensors.torch import load_file
        path = Path(adapter_dir) / "adapter_model.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"{adapter_dir}: no adapter_model.safetensors (not a LoRA checkpoint)")
        saved, ours = load_file(str(path)), {adapter_name(n): n for n in params}
        if set(saved) != set(ours):
            raise ValueError(f"{path}: its tensors are not this model's adapter's (another --lora-targets?): "
                             f"{sorted(set(saved) ^ set(ours))[:3]}")
        full = {ours[k]: v for k, v in saved.items()}
    else:
        g, full = torch.Generator().manual_seed(seed), {}
        for n, p in params.items():
            full[n] = torch.zeros(p.shape)
            if ".lora_A." in n:
                torch.nn.init.kaiming_uniform_(full[n], a=math.sqrt(5), generator=g)
    with torch.no_grad():
        for n, t in full.items():
            p = params[n]
            t = t.to(p.device, p.dtype)
            if hasattr(p, "to_local"):       # src_data_rank None: every rank has t, none sends
                t = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(t)
            else:
                p.copy_(t)


def load_into_engine(worker, tensors: dict, config: dict):
    """In a vLLM worker (weight_sync.WeightSyncWorker.load, the engine's `load`): the received adapter
    tensors replace the engine's adapter, ADAPTER_ID."""
    # vLLM's own LoRA loading, from tensors instead of a dir (what its LRU worker manager does for an
    # in-place reload): the new adapter replaces the old under the same id, and is made active, so
    # requests kept across the sync (keep mode) continue with it at their next step
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings":
                                   manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    mapper = getattr(worker.model_runner.get_model(), "hf_to_vllm_mapper", None)
    on_cpu = {n: t.to("cpu") for n, t in tensors.items()}      # (vLLM keeps adapters on the host)
    adapter = LoRAModel.from_lora_tensors(ADAPTER_ID, on_cpu, helper, device="cpu",
                                          dtype=manager.lora_config.lora_dtype,
                                          model_vocab_size=manager.vocab_size,
                                          weights_mapper=mapper.get_rename_mapper() if mapper else None)
    models = manager._adapter_manager           # (vLLM's LoRAModelManager: no public in-place load)
    models.remove_adapter(ADAPTER_ID)
    models.add_adapter(adapter)
    models.activate_adapter(ADAPTER_ID)


class LoraWeights(Weights):
    """trainer.Weights for an adapter: PEFT's around the model, only the adapter trains, syncs and is saved
    (a PEFT adapter dir, which PeftModel.from_pretrained and vLLM's LoRA loader read). adapter_dir: start
    from that saved adapter (a --resume); else PEFT's init from the trainer's seed."""
    switchable = True

    def __init__(self, cfg: LoraConfig, adapter_dir: str = ""):
        self.cfg, self.adapter_dir = cfg, adapter_dir

    def wrap(self, model):
        return wrap(model, self.cfg)

    def checkpoint_name(self, name: str) -> str | None:
        if is_adapter_tensor(name):
            return None
        return name.removeprefix("base_model.model.").replace(".base_layer.", ".")

    def init(self, model, seed: int):
        set_adapter(model, self.adapter_dir, seed)

    def named(self, model, tied: bool) -> list:
        return [(adapter_name(n), v) for n, v in model.state_dict().items() if is_adapter_tensor(n)]

    def save(self, tmp: Path, named, model, base_dir: str):
        save_adapter(tmp, named, self.cfg, base=base_dir)

    def off(self, model):
        return model.disable_adapter()


def lora_weights(cfg: LoraConfig, adapter_dir: str = "") -> LoraWeights | None:
    """The trainer's Weights for these flags: an adapter's, or None (rank 0: the whole model)."""
    return LoraWeights(cfg, adapter_dir) if cfg.lora_rank else None


def engine_kwargs(cfg: LoraConfig) -> dict:
    """AsyncEngineArgs' keywords for an engine that serves one adapter of this rank (serve_adapter: which)."""
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": engine_rank(cfg.lora_rank)}


def serve_adapter(engine, cfg: LoraConfig, base_dir: str, adapter_dir: str = ""):
    """Every request names the adapter: the one in adapter_dir (a resume), loaded at the first request;
    without one, none (the base model) until the first weight sync loads one into every worker."""
    engine.load = ("ext.lora:load_into_engine", cfg.adapter_config(base_dir))
    if adapter_dir:
        engine.request_kwargs["lora_request"] = request(adapter_dir)
    engine.after_receive.append(
        lambda: engine.request_kwargs.setdefault("lora_request", request("(weight sync)")))


def request(path: str):
    """vLLM's LoRARequest of the engine's adapter (a path even for one its workers hold: its origin)."""
    from vllm.lora.request import LoRARequest
    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, path)


@extension
class Lora(Extension):
    name, Config = "lora", LoraConfig
    adapter_dir = base_dir = ""

    @classmethod
    def wanted(cls, part) -> bool:
        return True     # (off, it still checks that a resumed run keeps the checkpoint's --lora-rank)

    def start_from(self, base_dir: str, ckpt: str, state):
        """A resumed run: the base model plus the checkpoint's adapter (the model dir stays the base's)."""
        saved = (state or {}).get("config", {}).get("ext", {}).get("lora", {}).get("lora_rank", 0)
        if state and saved != self.part.lora_rank:
            raise SystemExit(f"train.py: --resume: the checkpoint was trained with --lora-rank {saved}; "
                             f"resume with the same (got {self.part.lora_rank})")
        if not self.part.lora_rank:
            return None
        try:
            check_lora(self.part, base_dir)
        except ValueError as e:
            raise SystemExit(f"train.py: {e}") from None
        self.adapter_dir, self.base_dir = ckpt, base_dir
        return base_dir

    def trainer_weights(self):
        return lora_weights(self.part, self.adapter_dir)

    def engine_args(self, model_dir: str, device: str, who: str):
        return engine_kwargs(self.part) if self.part.lora_rank else None

    def on_engine(self, engine):
        if self.part.lora_rank:
            serve_adapter(engine, self.part, self.base_dir, self.adapter_dir)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "merge":
        sys.exit("usage: python -m ext.lora merge BASE_DIR ADAPTER_DIR OUT_DIR")
    for what, path in (("BASE_DIR", sys.argv[2]), ("ADAPTER_DIR", sys.argv[3])):
        if not Path(path).is_dir():
            sys.exit(f"lora merge: {what} {path}: no such directory")
    if not (Path(sys.argv[3]) / "adapter_config.json").exists():
        sys.exit(f"lora merge: ADAPTER_DIR {sys.argv[3]}: no adapter_config.json (not a PEFT adapter dir)")
    merge(*sys.argv[2:])
    print(f"lora merge: {sys.argv[2]} + {sys.argv[3]} -> {sys.argv[4]}")
