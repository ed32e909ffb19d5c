"""Child process for the crash tests: saves forever, announcing each commit on stdout.

Step s holds tensors whose content is a function of s alone, so the parent can check that
whatever is committed after a SIGKILL is exactly the state of that step.
"""

from __future__ import annotations

import sys

import torch

from tiercheck import Checkpointer, RetentionOptions, StagingOptions, WriteOptions


def content(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(512, 1024, generator=g),  # 2 MiB, 8 chunks of 256 KiB
        "b": torch.randn(4096, generator=g).to(torch.bfloat16),
        "step": torch.tensor(step),
    }


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    state = content(0)
    info = {"step": 0}
    with Checkpointer(
        {"tensors": state, "info": info},
        local=directory,
        staging=StagingOptions(mode=mode),  # type: ignore[arg-type]
        write=WriteOptions(chunk_bytes=256 << 10),
        retention=RetentionOptions(keep_last=2),
    ) as ck:
        last = ck.restore()
        step = 0 if last is None else last + 1
        print(f"ready {last}", flush=True)
        while True:
            for k, v in content(step).items():
                state[k].copy_(v)
            info["step"] = step
            h = ck.save(step)
            h.wait()
            print(f"committed {step}", flush=True)
            step += 1


if __name__ == "__main__":
    main()
