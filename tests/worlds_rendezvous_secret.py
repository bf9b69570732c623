"""Bodies for test_rendezvous_secret.py: an outside client on the same host against a one-host gloo job."""

from __future__ import annotations

import os
from datetime import timedelta


def outside_client() -> dict[str, object]:
    """Rank 0 connects to the job's store port as any local process would, with torch's TCPStore client,
    and tries to read the job's keys and write its own."""
    import torch.distributed as dist

    import phalanx

    outcome: dict[str, object] = {"read": None, "wrote": None}
    if phalanx.rank() == 0:
        try:
            store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=3), wait_for_workers=False)
            try:
                outcome["read"] = store.num_keys()
            except Exception as exc:  # noqa: BLE001 - any refusal is the point
                outcome["read"] = f"refused: {type(exc).__name__}"
            try:
                store.set("intruder", "x")
                outcome["wrote"] = "wrote"
            except Exception as exc:  # noqa: BLE001
                outcome["wrote"] = f"refused: {type(exc).__name__}"
        except Exception as exc:  # noqa: BLE001
            outcome["read"] = outcome["wrote"] = f"refused: {type(exc).__name__}"
    phalanx.barrier()
    return outcome
