"""Rollout policies kept the same on every router replica, through Redis (services/store/rollouts.py).

The models file gives each model's starting policy (epoch 0). A change through any replica (an
admin SetRollout or Rollback, an automatic rollback) is written to Redis as the model's next epoch
and announced on pub/sub; every replica applies a stored policy whose epoch is newer than the one it
holds: on the announcement, or at the latest ``poll_s`` later (the poll covers a lost announcement
or a client without pub/sub), and at start, so a restarted replica resumes the shared policy rather
than the file's. A stored policy replaces the policy whole, like a local change (requests in flight
keep the version they drew).

Failures fail open. With Redis unreachable a replica keeps its last known policy, logs
``rollout_store_unreachable`` once per outage (``rollout_store_reachable`` when it is back) and sets
``meshserve_router_rollout_store_up`` to 0. An admin change is then refused with UNAVAILABLE (the
other replicas would not see it); a rollback, manual or automatic, is applied on this replica at
once and written when Redis answers again (until then this replica takes no stored policy of that
model: the rollback wins over what was stored before it). A stored policy this replica cannot apply
(it names a version its models file lacks) is logged (``rollout_store_policy_refused``) and skipped.
Epochs never go back: a write is numbered above both the stored epoch and the writer's own, so a
Redis that lost its data (restarted without persistence) does not leave the replicas ignoring the
next change; and a replica that finds a policy it holds (epoch above 0) missing from Redis writes it
back (only if still missing: a newer write by another replica wins), so a router started later does
not fall back to the models file's policy (``rollout_store_restored``).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from services.common.errors import InvalidArgument, Unavailable
from services.router.frontend.models import ModelTable, ServedModel
from services.router.frontend.rollout import RollbackEvent, RolloutPolicy, policy_from_json, policy_to_json
from services.router.metrics import ROLLOUT_EPOCH, ROLLOUT_STORE_UP
from services.store.rollouts import RolloutStore, StoredPolicy

log = structlog.get_logger(__name__)


class RolloutSync:
    """Applies the shared policies of ``table``'s models and writes this replica's changes (see the
    module docstring). :meth:`start` reads the stored policies and starts the follower task."""

    def __init__(self, store: RolloutStore, table: ModelTable, *, poll_s: float, replica: str) -> None:
        self._store = store
        self._table = table
        self._poll_s = poll_s
        self._replica = replica
        self.epochs = {name: 0 for name in table.models}
        """Per model, the epoch of the policy in force here (0: the models file's)."""
        self.reachable = True
        """Whether the last call to Redis succeeded."""
        self._pending: dict[str, str] = {}  # model -> reason of a rollback not written yet
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        self._log = log.bind(replica=replica)
        for name in table.models:
            ROLLOUT_EPOCH.labels(name).set(0)
        ROLLOUT_STORE_UP.set(1)

    async def start(self) -> None:
        for model in self._table.models.values():
            model.rollout.add_rollback_listener(self._rolled_back)
        try:
            await self.refresh()
        except Unavailable as exc:
            self._unreachable(exc)
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="rollout-sync")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._flushes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._store.close()

    async def refresh(self, models: list[str] | None = None) -> None:
        """Read the stored policies of ``models`` (None: all) and apply the newer ones; Unavailable
        when Redis does not answer."""
        names = models or list(self._table.models)
        stored = await self._store.read(names)
        self._reachable()
        for entry in stored.values():
            self._apply(entry)
        for name in names:
            if name not in stored and self.epochs[name] > 0 and name not in self._pending:
                await self._restore(name)

    async def _restore(self, name: str) -> None:
        """Write back a shared policy Redis lost (restarted without persistence, evicted), unless
        another replica wrote one first: a router started now gets it rather than the models file's."""
        policy = policy_to_json(self._table.models[name].rollout.policy)
        held = self.epochs[name]
        epoch = await self._store.write(name, policy, by=self._replica, reason="restore", floor=held, if_missing=True)
        if epoch:
            self.epochs[name] = epoch
            ROLLOUT_EPOCH.labels(name).set(epoch)
            self._log.warning("rollout_store_restored", model=name, epoch=epoch, held=held)

    async def publish(self, model: ServedModel, policy: RolloutPolicy) -> RolloutPolicy:
        """Write ``policy`` (checked: InvalidArgument changes nothing) as ``model``'s next epoch, then
        apply it here; Unavailable (nothing changed anywhere) when Redis does not take it."""
        policy.check(model.rollout.versions, model.id)
        async with self._lock:  # a rollback being written cannot land after (and over) this change
            try:
                epoch = await self._store.write(
                    model.id, policy_to_json(policy), by=self._replica, reason="set", floor=self.epochs[model.id]
                )
            except Unavailable as exc:
                self._unreachable(exc)
                raise Unavailable(
                    "the rollout store (Redis) is unreachable, so the other router replicas would not see this "
                    "change; nothing was changed: retry when Redis answers (`meshserve models rollback` still works)"
                ) from None
            self._reachable()
            self._pending.pop(model.id, None)  # the new policy supersedes a rollback not written yet
            self._set(model, policy, epoch)
        self._log.info("rollout_changed", model=model.id, epoch=epoch, **_fields(policy))
        return model.rollout.policy

    async def flush(self) -> None:
        """Write the rollbacks not written yet; Unavailable when Redis does not take them (they stay)."""
        async with self._lock:
            for name, reason in list(self._pending.items()):
                model = self._table.models[name]
                epoch = await self._store.write(
                    name, policy_to_json(model.rollout.policy), by=self._replica, reason=reason, floor=self.epochs[name]
                )
                self._reachable()
                if self._pending.get(name) == reason:
                    del self._pending[name]
                self.epochs[name] = max(self.epochs[name], epoch)
                ROLLOUT_EPOCH.labels(name).set(self.epochs[name])
                self._log.info("rollout_rollback_shared", model=name, epoch=epoch, reason=reason)

    def pending(self, model: str) -> bool:
        """True while a rollback of ``model`` applied here is not written to Redis yet."""
        return model in self._pending

    def _rolled_back(self, event: RollbackEvent) -> None:
        self._pending[event.model] = event.reason
        try:  # written now rather than at the follower's next turn (up to poll_s away)
            task = asyncio.get_running_loop().create_task(self._flush_quietly(), name="rollout-share")
        except RuntimeError:  # no loop (a caller outside the router): the follower writes it
            return
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush_quietly(self) -> None:
        try:
            await self.flush()
        except Unavailable as exc:
            self._unreachable(exc)  # the follower retries

    def _apply(self, entry: StoredPolicy) -> None:
        if entry.epoch <= self.epochs.get(entry.model, entry.epoch) or entry.model in self._pending:
            return
        model = self._table.models[entry.model]
        try:
            policy = policy_from_json(entry.policy).check(model.rollout.versions, model.id)
        except InvalidArgument as exc:
            self._log.warning(
                "rollout_store_policy_refused", model=model.id, epoch=entry.epoch, by=entry.by, why=exc.message
            )
            self.epochs[model.id] = entry.epoch  # not again: the next change is a new epoch
            return
        self._set(model, policy, entry.epoch)
        self._log.info("rollout_applied", model=model.id, epoch=entry.epoch, by=entry.by, reason=entry.reason)

    def _set(self, model: ServedModel, policy: RolloutPolicy, epoch: int) -> None:
        if epoch <= self.epochs[model.id]:
            return  # a newer policy is in force already
        model.rollout.set_policy(policy)
        self.epochs[model.id] = epoch
        ROLLOUT_EPOCH.labels(model.id).set(epoch)

    def _reachable(self) -> None:
        if not self.reachable:
            self._log.info("rollout_store_reachable")
        self.reachable = True
        ROLLOUT_STORE_UP.set(1)

    def _unreachable(self, exc: Unavailable) -> None:
        if self.reachable:
            self._log.warning("rollout_store_unreachable", error=exc.message, keeping="the last known policies")
        self.reachable = False
        ROLLOUT_STORE_UP.set(0)

    async def _follow(self) -> None:
        """Write pending rollbacks, wait for a notice (or the poll interval), re-read; forever."""
        notices = self._store.notices(self._poll_s)
        try:
            while True:
                started = time.monotonic()
                try:
                    if self._pending:
                        await self.flush()
                    changed = await notices.next()
                    if changed is None and time.monotonic() - started < self._poll_s / 2:
                        # A subscription's confirmation: re-read once, but never in a tight loop.
                        await asyncio.sleep(self._poll_s / 2)
                    await self.refresh([changed] if changed in self._table.models else None)
                except Unavailable as exc:
                    self._unreachable(exc)
                    await asyncio.sleep(self._poll_s)
                except Exception:  # a bug here must not stop the follower: logged, retried
                    self._log.exception("rollout_sync_failed")
                    await asyncio.sleep(self._poll_s)
        finally:
            await notices.close()


def _fields(policy: RolloutPolicy) -> dict[str, object]:
    return {
        "weights": dict(policy.weights),
        "sticky": policy.sticky,
        "shadow": policy.shadow or "",
        "primary": policy.primary,
        "rollback": policy.rollback is not None,
    }
