"""Third-party models shared by runs (``output.shared_store``): trained once, adopted by every run that needs them.

A pretrain stage's key is a content hash of everything its model depends on (pool, model, training settings, seed,
classifier family, code version), so two runs whose graphs hold the same key need the same bytes. The shared
store is an ordinary :class:`~pipelines.store.run_store.RunStore` (local folder or ``s3://`` URI):

- ``adopt``: the stage is committed there, so its verified blobs and manifest are copied into the run's own store
  (the run folder stays self-contained: moved or copied, it loads its own weights). A copy that fails its sha256
  is uncommitted in the shared store (with a warning) and the run trains and publishes the model again.
- ``claim``: nobody has it yet, so the run takes a claim on the key before training it; a second run that needs
  the same key while the claim is held waits for it instead of training it again. Claims are
  :func:`pipelines.store.lease.run_lease` leases on ``claims/<key>`` (an fcntl lock locally, a heartbeat object on S3), so
  a claim of a killed run is released at once (local) or after ``lease.STALE_S`` (S3), and another run trains it;
  a claim whose holder stopped beating (paused) is taken over after the stale time; a waiting run logs what it
  waits for (the holder's pid, host and last heartbeat).
- ``publish``: after the run committed the stage in its own store, the same bytes are copied to the shared store,
  then the claim is released.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterable

from compat_core.integrity import IntegrityError
from pipelines.graph.stage_kind import StageKind
from pipelines.store.lease import RunFolderBusyError, run_lease
from pipelines.store.run_store import RunStore

log = logging.getLogger(__name__)

REPORT_EVERY_S = 60.0  # a run waiting for another run's claim says so at most this often per stage
SHARED_KINDS = (StageKind.PRETRAIN,)  # stage kinds a shared store holds: the third-party models
CLAIMS = "claims"


def copy_stage(source: RunStore, target: RunStore, stage_key: str) -> int:
    """Copy a committed stage (blobs verified against the source manifest, then the manifest last, so the target
    never shows a stage whose blobs are missing); returns the bytes copied."""
    manifest = source.load_manifest(stage_key)
    blobs = {name: source.read_blob(stage_key, name, manifest) for name in sorted(manifest["blobs"])}
    target.commit(stage_key, manifest["record"], blobs, code_version=manifest.get("code_version"),
                  precision=manifest.get("precision"))
    return sum(len(data) for data in blobs.values())


class SharedStore:
    """Adopt, claim and publish shared stages of one run (see the module docstring). ``close`` releases claims."""

    def __init__(self, root: str) -> None:
        self.store = RunStore(root)
        self.claims: dict[str, contextlib.ExitStack] = {}
        self.reported: dict[str, float] = {}  # stage key -> when its wait was last reported (monotonic s)

    @staticmethod
    def covers(kind: StageKind) -> bool:
        """Whether stages of this kind are shared."""
        return kind in SHARED_KINDS

    def adopt(self, stage_key: str, store: RunStore) -> bool:
        """Copy the stage into ``store`` when the shared store has it; returns whether it did."""
        if not self.store.has(stage_key):
            return False
        try:
            size = copy_stage(self.store, store, stage_key)
        except IntegrityError as error:
            # nothing was written to the run (every blob is verified before the first write); the bad copy is
            # uncommitted so that this run trains the model and publishes it again
            log.warning("shared store %s: %s; stage %s is uncommitted there and trained again", self.store.root,
                        error, stage_key)
            self.store.forget(stage_key)
            return False
        log.info("stage %s adopted from the shared store %s (%d bytes)", stage_key, self.store.root, size)
        return True

    def claim(self, stage_key: str) -> bool:
        """Take the claim on training ``stage_key``; False when another live process holds it (then wait and
        ``adopt`` once it is published). Claims already held by this object return True."""
        if stage_key in self.claims:
            return True
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(run_lease(self.store.uri(CLAIMS, stage_key)))
        except RunFolderBusyError as error:
            stack.close()
            now = time.monotonic()
            if now - self.reported.get(stage_key, -1e9) >= REPORT_EVERY_S:  # say what the run waits for
                self.reported[stage_key] = now
                holder = str(error).replace("run folder", "claim", 1).split("; wait for it", 1)[0]
                log.warning("waiting for stage %s: another run is training it for the shared store %s (%s); this run "
                            "goes on with its other stages and adopts that model once it is published", stage_key,
                            self.store.root, holder)
            return False
        self.claims[stage_key] = stack
        return True

    def publish(self, stage_key: str, store: RunStore) -> bool:
        """Copy the stage this run committed to the shared store, then release its claim; returns False when it
        was there already (published by another run meanwhile)."""
        try:
            if self.store.has(stage_key):
                return False
            size = copy_stage(store, self.store, stage_key)
            log.info("stage %s published to the shared store %s (%d bytes)", stage_key, self.store.root, size)
            return True
        finally:
            self.release([stage_key])

    def release(self, stage_keys: Iterable[str] | None = None) -> None:
        """Drop the claims on ``stage_keys`` (None: every claim held)."""
        for key in list(self.claims if stage_keys is None else stage_keys):
            stack = self.claims.pop(key, None)
            if stack is not None:
                stack.close()

    def close(self) -> None:
        self.release()
