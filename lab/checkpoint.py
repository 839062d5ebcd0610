"""Checkpoints with orbax: atomic saves, and restores that never load a damaged step.

Orbax writes each step to a temporary folder and renames it when complete, so an interrupted
save is never listed. A step that is listed but fails to restore (a file truncated or
deleted afterwards) is skipped with a warning and the next older one is tried.
"""

import os
import sys

import orbax.checkpoint as ocp


def manager(run_dir: str, *, max_to_keep: int = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(run_dir, "checkpoints")), options=options
    )


def save(mngr: ocp.CheckpointManager, step: int, state, *, wait: bool = False) -> None:
    mngr.save(step, args=ocp.args.StandardSave(state), force=True)
    if wait:
        mngr.wait_until_finished()


def restore_latest(mngr: ocp.CheckpointManager, abstract_state):
    """(step, state) from the newest checkpoint that restores whole, or (None, None)."""
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            state = mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except Exception as e:  # orbax raises many types for damaged files; all mean "skip"
            first_line = (
                str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            )
            print(
                f"warning: checkpoint step {step} is damaged, skipped ({first_line})",
                file=sys.stderr,
            )
            continue
        return step, state
    return None, None
