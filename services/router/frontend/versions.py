"""Model versions on the request path: one turn on one version (:class:`VersionRun`: per-version
metrics, the primary's samples for the automatic rollback of services/router/frontend/rollout.py) and shadow
copies (:class:`Shadows`: a copy of each turn that succeeded, run on the shadow version in the
background, at most ``max_in_flight`` at once, more shed; its output is discarded, its TTFT and its
agreement with the primary are counted).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import replace

import structlog

from services.common.errors import MeshError
from services.router.balancer.core import Session
from services.router.frontend.models import ServedModel, ServedVersion
from services.router.frontend.rollout import SERVER_FAULTS
from services.router.metrics import SHADOW, VERSION_REQUESTS, VERSION_TTFT
from services.router.types import Chunk, Done, Event, TurnRequest

log = structlog.get_logger(__name__)


class VersionRun:
    """One turn on one version: its TTFT and status in the per-version metrics, and (the primary's)
    a sample for the model's automatic rollback; the text when ``keep_text``. A context manager:
    leaving it with a MeshError records that status; a cancelled turn is no sample."""

    def __init__(
        self, model: ServedModel, version: ServedVersion, role: str, *, keep_text: bool = False, choices: int = 1
    ) -> None:
        self.model = model
        self.version = version
        self.role = role
        self.started = time.perf_counter()
        self.ttft: float | None = None
        self.text: dict[int, list[str]] | None = {} if keep_text else None
        """Per choice index, its text (when ``keep_text``)."""
        self.done = False
        self.dones = 0
        self.choices = choices

    def see(self, event: Event) -> bool:
        """Count ``event``; True at the turn's last Done (one per choice) when the text is kept."""
        if isinstance(event, Done):
            self.done = True  # a caller that stops reading after the Done closed a turn that succeeded
            self.dones += 1
            return self.text is not None and self.dones == self.choices
        if isinstance(event, Chunk):
            if self.ttft is None:
                self.ttft = time.perf_counter() - self.started
            if self.text is not None:
                self.text.setdefault(event.index, []).append(event.text)
        return False

    def output(self) -> str:
        """Every choice's text, in choice order (what a shadow's output is compared with)."""
        text = self.text or {}
        return "\0".join("".join(text[i]) for i in sorted(text))

    def __enter__(self) -> VersionRun:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if kind is None or (self.done and issubclass(kind, (asyncio.CancelledError, GeneratorExit))):
            status = "OK"
        elif isinstance(exc, MeshError):
            status = exc.code
        elif issubclass(kind, (asyncio.CancelledError, GeneratorExit)):
            status = "CANCELLED"
        else:
            status = "INTERNAL"
        model, name, children = self.model.id, self.version.name, self.version.metrics
        if (requests := children.get((self.role, status))) is None:
            requests = children[self.role, status] = VERSION_REQUESTS.labels(model, name, self.role, status)
        requests.inc()
        if self.ttft is not None:
            if (ttft := children.get((self.role,))) is None:
                ttft = children[self.role,] = VERSION_TTFT.labels(model, name, self.role)
            ttft.observe(self.ttft)
        if self.role == "primary" and status != "CANCELLED":
            self.model.rollout.record(name, failed=status in SERVER_FAULTS, ttft_s=self.ttft)


def shadow_copy(req: TurnRequest, timeout: float | None, done: Event) -> TurnRequest:
    """The shadow's request: the primary's, on the tier whose weights answered it (a chat's later turns
    stay on their first turn's tier, which a stand-alone copy of a longer prompt would not pick)."""
    tier = done.route.tier if isinstance(done, Done) and not done.route.cache_hit else None
    return replace(req, timeout=timeout, hint=tier or req.hint)


def shadow_of(model: ServedModel, version: ServedVersion) -> str | None:
    """The version that gets a copy of a turn served by ``version`` (None: no shadow, or it is itself)."""
    shadow = model.rollout.policy.shadow
    return shadow if shadow is not None and shadow != version.name else None


class Shadows:
    """The shadow copies of one API's turns."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.running: set[asyncio.Task[None]] = set()
        """Shadow copies running now (tests wait on them)."""

    def start(self, model: ServedModel, name: str, req: TurnRequest, primary_text: str) -> None:
        """Run ``req`` on version ``name`` in the background (the primary's answer is already out)."""
        version = model.versions.get(name)
        if version is None:
            return
        counters = model.rollout.counters[name]
        if len(self.running) >= self.max_in_flight:
            counters.shadow_shed += 1
            SHADOW.labels(model.id, name, "shed").inc()
            return
        counters.shadow_requests += 1
        # Its own prefix hashes (another build), no response cache (a real run), no rate-limit charge.
        copy = replace(req, prefix_blocks=None, use_cache=False, request_id=f"{req.request_id}-shadow")
        task = asyncio.create_task(self._run(model, version, copy, primary_text), name="router-shadow")
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _run(self, model: ServedModel, version: ServedVersion, req: TurnRequest, primary_text: str) -> None:
        run = VersionRun(model, version, "shadow", keep_text=True, choices=req.sampling.n)
        session = Session()
        outcome = "failed"
        try:
            with run:
                async with aclosing(version.router.run_turn(req, session)) as events:
                    async for event in events:
                        run.see(event)
            assert run.text is not None
            counters = model.rollout.counters[version.name]
            if req.sampling.deterministic:
                counters.shadow_compared += 1
                agreed = run.output() == primary_text
                counters.shadow_agreed += agreed
                outcome = "agreed" if agreed else "differed"
            else:
                outcome = "not_compared"
        except MeshError as exc:  # a shadow's failure is counted, never seen by a caller
            log.info("shadow_failed", model=model.id, version=version.name, code=exc.code)
        except Exception:
            log.exception("shadow_failed", model=model.id, version=version.name)
        finally:
            await session.close()
            SHADOW.labels(model.id, version.name, outcome).inc()
