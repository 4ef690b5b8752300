"""The rater web UI (server-rendered pages) and its JSON API on the service's HTTP port,
translation only.

Pages: ``/ui/login``, ``/ui/rate`` (the queue: one comparison at a time, A / B / tie / both bad,
optional reason, keyboard shortcuts, progress), ``/ui/admin`` (rater statistics, agreement,
flagged raters, reward-model versions with a form to register one and to change a status;
admins only). JSON: the rating API and the reward-model registry (admins only), bearer tokens.

Security, and why:
- sessions are random cookie tokens stored hashed (:meth:`FeedbackService.login`), ``HttpOnly``
  and ``SameSite=Strict`` so scripts and cross-site requests cannot use them;
- every form carries a CSRF token: the session's synchroniser token once logged in, and a
  double-submit cookie on the login form (login CSRF would log a victim in as the attacker);
- a Content-Security-Policy allowing only this origin's script, so injected markup cannot run;
  all text is escaped by Jinja2's autoescape.
A double click posts the same answer twice; the service records it once, and the page script
disables the buttons after the first press.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from forge.common.v1 import common_pb2
from jinja2 import Environment, PackageLoader, select_autoescape
from pydantic import BaseModel, Field

from forge_kit import errors
from forge_kit.paging import MAX_OFFSET
from forge_kit.validate import FiniteFloat
from forge_preference_feedback.quality import QualityPolicy
from forge_preference_feedback.registry import HeldoutAccuracy, RewardModelRegistry, heldout_of
from forge_preference_feedback.rounds import RlhfRounds
from forge_preference_feedback.service import FeedbackService, Session
from forge_preference_feedback.store import ComparisonRow, RewardModelRow

UI_VERSION = "web-1"
SESSION_COOKIE = "forge_feedback_session"
LOGIN_CSRF_COOKIE = "forge_feedback_login_csrf"
CHOICES = {
    "A": common_pb2.PREFERENCE_CHOICE_A,
    "B": common_pb2.PREFERENCE_CHOICE_B,
    "TIE": common_pb2.PREFERENCE_CHOICE_TIE,
    "BOTH_BAD": common_pb2.PREFERENCE_CHOICE_BOTH_BAD,
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
STATIC = {"rate.js": "text/javascript", "style.css": "text/css"}

_templates = Environment(
    loader=PackageLoader("forge_preference_feedback", "templates"),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)


def _fmt(value: float, spec: str = ".2f") -> str:
    return "–" if value != value or math.isinf(value) else format(value, spec)


_templates.filters["fmt"] = _fmt


def _page(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    html = _templates.get_template(template).render(ui_version=UI_VERSION, **context)
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


def _csrf_ok(expected: str, given: str) -> bool:
    return bool(expected) and secrets.compare_digest(expected.encode(), given.encode())


def rater_ui(
    service: FeedbackService,
    registry: RewardModelRegistry,
    *,
    secure_cookies: bool,
    session_max_age_s: int,
    policy: QualityPolicy = QualityPolicy(),
    rounds: RlhfRounds | None = None,
) -> APIRouter:
    """The ``/ui`` routes over ``service``; ``secure_cookies`` marks cookies HTTPS-only."""
    router = APIRouter(prefix="/ui", include_in_schema=False)

    async def current(request: Request) -> Session | None:
        return await service.session_for(request.cookies.get(SESSION_COOKIE, ""))

    def to_login() -> Response:
        return RedirectResponse("/ui/login", status_code=303, headers=SECURITY_HEADERS)

    Handler = Callable[[Session], Awaitable[Response]]

    async def guarded(request: Request, csrf: str | None, admin: bool, handler: Handler) -> Response:
        """1. A session is required (pages redirect to login; form posts get 401). 2. Admin
        pages need an admin (403). 3. Posts must carry the session's CSRF token (403)."""
        session = await current(request)
        if session is None:
            if csrf is None:
                return to_login()
            return _page("error.html", 401, title="Not logged in", message="Log in again.", session=None)
        if admin and not session.is_admin:
            return _page("error.html", 403, title="Forbidden", message="Admins only.", session=session)
        if csrf is not None and not _csrf_ok(session.csrf_token, csrf):
            return _page(
                "error.html",
                403,
                title="Forbidden",
                message="Invalid or missing CSRF token.",
                session=session,
            )
        return await handler(session)

    @router.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC:
            raise errors.NotFoundError(f"no static file {name!r}")
        body = resources.files("forge_preference_feedback").joinpath("static", name).read_bytes()
        return Response(body, media_type=STATIC[name], headers={"Cache-Control": "max-age=300"})

    @router.get("")
    async def root(request: Request) -> Response:
        session = await current(request)
        return RedirectResponse("/ui/rate" if session else "/ui/login", status_code=303)

    @router.get("/login")
    async def login_page(request: Request) -> Response:
        token = secrets.token_urlsafe(32)
        response = _page("login.html", csrf=token, error="", rater_id="", session=None)
        response.set_cookie(
            LOGIN_CSRF_COOKIE, token, httponly=True, samesite="strict", secure=secure_cookies, path="/ui"
        )
        return response

    @router.post("/login")
    async def login(
        request: Request,
        rater_id: Annotated[str, Form()] = "",
        password: Annotated[str, Form()] = "",
        csrf: Annotated[str, Form()] = "",
    ) -> Response:
        if not _csrf_ok(request.cookies.get(LOGIN_CSRF_COOKIE, ""), csrf):
            return _page(
                "error.html", 403, title="Forbidden", message="Invalid or missing CSRF token.", session=None
            )
        try:
            token, _ = await service.login(rater_id, password)
        except errors.UnauthenticatedError as exc:
            return _page(
                "login.html", 401, csrf=csrf, error=exc.message, rater_id=rater_id[:128], session=None
            )
        response = RedirectResponse("/ui/rate", status_code=303, headers=SECURITY_HEADERS)
        response.set_cookie(
            SESSION_COOKIE,
            token,
            httponly=True,
            samesite="strict",
            secure=secure_cookies,
            path="/",
            max_age=session_max_age_s,
        )
        response.delete_cookie(LOGIN_CSRF_COOKIE, path="/ui")
        return response

    @router.post("/logout")
    async def logout(request: Request, csrf: Annotated[str, Form()] = "") -> Response:
        async def handle(session: Session) -> Response:
            await service.logout(request.cookies.get(SESSION_COOKIE, ""))
            response = to_login()
            response.delete_cookie(SESSION_COOKIE, path="/")
            return response

        return await guarded(request, csrf, False, handle)

    @router.get("/rate")
    async def rate_page(request: Request, recorded: str = "") -> Response:
        async def handle(session: Session) -> Response:
            item = await service.next_comparison(session.rater_id)
            progress = await service.progress(session.rater_id)
            return _page(
                "rate.html", session=session, item=item, progress=progress, recorded=recorded[:40], error=""
            )

        return await guarded(request, None, False, handle)

    @router.post("/rate")
    async def rate(
        request: Request,
        comparison_id: Annotated[str, Form()] = "",
        choice: Annotated[str, Form()] = "",
        reason: Annotated[str, Form()] = "",
        csrf: Annotated[str, Form()] = "",
    ) -> Response:
        async def handle(session: Session) -> Response:
            try:
                if choice not in CHOICES:
                    raise errors.ValidationError("choice", "must be A, B, TIE or BOTH_BAD")
                row = await service.submit_preference(
                    comparison_id, session.rater_id, CHOICES[choice], 1.0, reason.strip(), UI_VERSION
                )
            except (errors.ValidationError, errors.AlreadyExistsError) as exc:
                status = 409 if isinstance(exc, errors.AlreadyExistsError) else 400
                field = getattr(exc, "field", "")
                message = f"{field}: {exc.message}" if field else exc.message
                return _page("error.html", status, title="Not recorded", message=message, session=session)
            return RedirectResponse(f"/ui/rate?recorded={row.id}", status_code=303, headers=SECURITY_HEADERS)

        return await guarded(request, csrf, False, handle)

    @router.get("/admin")
    async def admin_page(request: Request) -> Response:
        async def handle(session: Session) -> Response:
            report = await service.rater_quality(policy)
            models, _ = await registry.list("", 100, 0)
            return _page(
                "admin.html",
                session=session,
                report=report,
                models=models,
                origins=await service.comparison_origins(),
                policy=policy,
                heldout_of=heldout_of,
            )

        return await guarded(request, None, True, handle)

    @router.get("/admin/rlhf")
    async def rlhf_page(request: Request) -> Response:
        async def handle(session: Session) -> Response:
            rows, total = await rounds.list("", 200, 0) if rounds is not None else ([], 0)
            return _page("rlhf.html", session=session, rounds=rows, total=total)

        return await guarded(request, None, True, handle)

    @router.post("/admin/reward-models")
    async def set_status(
        request: Request,
        name: Annotated[str, Form()] = "",
        version: Annotated[str, Form()] = "",
        status: Annotated[str, Form()] = "",
        csrf: Annotated[str, Form()] = "",
    ) -> Response:
        async def handle(session: Session) -> Response:
            try:
                await registry.set_status(name, version, status, changed_by=session.rater_id)
            except (errors.ValidationError, errors.NotFoundError) as exc:
                code = 404 if isinstance(exc, errors.NotFoundError) else 400
                return _page("error.html", code, title="Not changed", message=exc.message, session=session)
            return RedirectResponse("/ui/admin", status_code=303, headers=SECURITY_HEADERS)

        return await guarded(request, csrf, True, handle)

    @router.post("/admin/reward-models/new")
    async def register(
        request: Request,
        name: Annotated[str, Form()] = "",
        version: Annotated[str, Form()] = "",
        uri: Annotated[str, Form()] = "",
        snapshot_id: Annotated[str, Form()] = "",
        backbone: Annotated[str, Form()] = "",
        accuracy: Annotated[str, Form()] = "",
        ci95_low: Annotated[str, Form()] = "",
        ci95_high: Annotated[str, Form()] = "",
        n: Annotated[str, Form()] = "",
        interval: Annotated[str, Form()] = "wilson",
        csrf: Annotated[str, Form()] = "",
    ) -> Response:
        async def handle(session: Session) -> Response:
            try:
                heldout = HeldoutAccuracy(
                    _number("heldout.accuracy", accuracy),
                    _number("heldout.ci95_low", ci95_low),
                    _number("heldout.ci95_high", ci95_high),
                    int(_number("heldout.n", n, integer=True)),
                    interval,
                )
                await registry.register(
                    name,
                    version,
                    uri=uri,
                    snapshot_id=snapshot_id,
                    backbone=backbone,
                    heldout=heldout,
                    registered_by=session.rater_id,
                )
            except (errors.ValidationError, errors.AlreadyExistsError) as exc:
                code = 409 if isinstance(exc, errors.AlreadyExistsError) else 400
                field = getattr(exc, "field", "")
                message = f"{field}: {exc.message}" if field else exc.message
                return _page("error.html", code, title="Not registered", message=message, session=session)
            return RedirectResponse("/ui/admin", status_code=303, headers=SECURITY_HEADERS)

        return await guarded(request, csrf, True, handle)

    return router


def _number(field: str, text: str, *, integer: bool = False) -> float:
    """A form field as a number, or ValidationError naming it."""
    try:
        value = float(int(text)) if integer else float(text)
    except ValueError:
        raise errors.ValidationError(
            field, f"must be {'a whole number' if integer else 'a number'}"
        ) from None
    return value


def reward_model_json(row: RewardModelRow) -> dict[str, object]:
    """A reward-model version as the JSON API shows it."""
    heldout = heldout_of(row)
    return {
        "name": row.name,
        "version": row.version,
        "uri": row.uri,
        "status": row.status,
        "snapshot_id": row.snapshot_id,
        "backbone": row.backbone,
        "heldout": None
        if heldout is None
        else {
            "accuracy": heldout.accuracy,
            "ci95_low": heldout.ci95_low,
            "ci95_high": heldout.ci95_high,
            "n": heldout.n,
            "interval": heldout.interval,
        },
        "metrics": dict(row.metrics),
        "created_at": row.created_at.isoformat() + "Z",
        "registered_by": row.registered_by,
        "status_changed_at": row.status_changed_at.isoformat() + "Z" if row.status_changed_at else None,
        "status_changed_by": row.status_changed_by,
    }


class LoginBody(BaseModel):
    """``POST /api/v1/sessions``."""

    rater_id: str = Field(max_length=128)
    password: str = Field(max_length=256)


class PreferenceBody(BaseModel):
    """``POST /api/v1/preferences``: the rater's answer to a comparison handed to them."""

    comparison_id: str = Field(max_length=64)
    choice: str = Field(description="A, B, TIE or BOTH_BAD")
    reason: str = ""
    confidence: FiniteFloat = 1.0
    next: bool = Field(
        default=False,
        description="also hand the rater their next comparison in the reply, as "
        "GET /api/v1/comparisons/next would: one round trip per item",
    )


def comparison_json(row: ComparisonRow | None) -> dict[str, str] | None:
    """A comparison as the rater API shows it (None when nothing is left for the rater): the
    same fields whatever its origin, so a rater cannot tell policy samples from seed data."""
    if row is None:
        return None
    return {
        "id": row.id,
        "prompt": row.prompt,
        "response_a": row.response_a_text,
        "response_b": row.response_b_text,
    }


def admin_comparison_json(row: ComparisonRow) -> dict[str, object]:
    """A comparison as admins see it: the rater's fields plus where it comes from."""
    return {
        **(comparison_json(row) or {}),
        "origin": row.origin,
        "batch": row.batch,
        "source": row.source,
        "model_a": row.response_a_model,
        "model_b": row.response_b_model,
        "answers": row.answer_count,
    }


class HeldoutBody(BaseModel):
    """Held-out pairwise accuracy with its 95 % interval."""

    accuracy: FiniteFloat
    ci95_low: FiniteFloat
    ci95_high: FiniteFloat
    n: int = Field(le=2**31 - 1)
    interval: str = Field(default="wilson", description="wilson or bootstrap")


class RewardModelBody(BaseModel):
    """``POST /api/v1/reward-models``: a new immutable version (admins only)."""

    name: str = Field(max_length=128)
    version: str = Field(default="", max_length=64, description="empty: the next integer")
    uri: str = Field(max_length=4096, description="checkpoint location")
    snapshot_id: str = Field(max_length=128)
    backbone: str = Field(max_length=255)
    heldout: HeldoutBody
    metrics: dict[str, FiniteFloat] = Field(default_factory=dict)


class StatusBody(BaseModel):
    """``POST /api/v1/reward-models/{name}/{version}/status`` (admins only)."""

    status: str = Field(description="candidate, active or retired")


def rater_api(
    service: FeedbackService, registry: RewardModelRegistry, *, ui_version: str = "api-1"
) -> APIRouter:
    """JSON API for rating tools and load tests: ``POST /api/v1/sessions`` (log in, get a bearer
    token), ``GET /api/v1/comparisons/next``, ``POST /api/v1/preferences``; and the reward-model
    registry for admins: ``GET /api/v1/reward-models``, ``GET /api/v1/reward-models/{name}/{version}``
    (version ``latest`` or ``active`` too), ``POST /api/v1/reward-models``,
    ``POST /api/v1/reward-models/{name}/{version}/status``. Bearer tokens are not sent by browsers
    on their own, so these routes need no CSRF token; errors are the kit's JSON bodies naming the
    field (401 without a session, 403 for a rater who is not an admin)."""
    router = APIRouter(prefix="/api/v1")

    async def bearer(request: Request) -> Session:
        header = request.headers.get("authorization", "")
        token = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        session = await service.session_for(token)
        if session is None:
            raise errors.UnauthenticatedError("missing, unknown or expired session token")
        return session

    @router.post("/sessions")
    async def open_session(body: LoginBody) -> dict[str, object]:
        token, session = await service.login(body.rater_id, body.password)
        return {"token": token, "rater_id": session.rater_id, "is_admin": session.is_admin}

    @router.get("/comparisons/next")
    async def next_comparison(request: Request) -> dict[str, object]:
        session = await bearer(request)
        return {"comparison": comparison_json(await service.next_comparison(session.rater_id))}

    @router.get("/comparisons")
    async def list_comparisons(
        request: Request,
        origin: Annotated[str, Query(max_length=16)] = "",
        batch: Annotated[str, Query(max_length=128)] = "",
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    ) -> dict[str, object]:
        """Comparisons with their origin (seed data, policy samples, shadow pairs): admins only."""
        await admin(request, "the comparisons' origins")
        rows = await service.list_comparisons(origin=origin, batch=batch, limit=limit, offset=offset)
        return {"comparisons": [admin_comparison_json(r) for r in rows]}

    @router.post("/preferences")
    async def submit(body: PreferenceBody, request: Request) -> dict[str, object]:
        session = await bearer(request)
        if body.choice not in CHOICES:
            raise errors.ValidationError("choice", "must be A, B, TIE or BOTH_BAD")
        row = await service.submit_preference(
            body.comparison_id,
            session.rater_id,
            CHOICES[body.choice],
            body.confidence,
            body.reason,
            ui_version,
        )
        if not body.next:
            return {"preference_id": row.id}
        # Recorded first: a failure here loses no answer, and a retry of the same post records
        # nothing twice and is handed the same next item (the rater's live lease comes back).
        following = await service.next_comparison(session.rater_id)
        return {"preference_id": row.id, "next": {"comparison": comparison_json(following)}}

    async def admin(request: Request, action: str) -> Session:
        session = await bearer(request)
        if not session.is_admin:
            raise errors.PermissionDeniedError(f"{action} is for admins; {session.rater_id} is not one")
        return session

    @router.get("/reward-models")
    async def list_models(
        request: Request, name: str = "", page_size: int = 50, offset: int = 0
    ) -> dict[str, object]:
        await admin(request, "the reward-model registry")
        if not 1 <= page_size <= 500:
            raise errors.ValidationError("page_size", "must be between 1 and 500")
        if not 0 <= offset <= MAX_OFFSET:
            raise errors.ValidationError("offset", f"must be between 0 and {MAX_OFFSET}")
        rows, total = await registry.list(name, page_size, offset)
        return {"reward_models": [reward_model_json(r) for r in rows], "total": total}

    @router.get("/reward-models/{name}/{version}")
    async def get_model(request: Request, name: str, version: str) -> dict[str, object]:
        await admin(request, "the reward-model registry")
        return reward_model_json(await registry.get(name, version))

    @router.post("/reward-models", status_code=201)
    async def register_model(body: RewardModelBody, request: Request) -> dict[str, object]:
        session = await admin(request, "registering a reward model")
        h = body.heldout
        row = await registry.register(
            body.name,
            body.version,
            uri=body.uri,
            snapshot_id=body.snapshot_id,
            backbone=body.backbone,
            heldout=HeldoutAccuracy(h.accuracy, h.ci95_low, h.ci95_high, h.n, h.interval),
            metrics=body.metrics,
            registered_by=session.rater_id,
        )
        return reward_model_json(row)

    @router.post("/reward-models/{name}/{version}/status")
    async def set_model_status(
        name: str, version: str, body: StatusBody, request: Request
    ) -> dict[str, object]:
        session = await admin(request, "changing a reward model's status")
        return reward_model_json(
            await registry.set_status(name, version, body.status, changed_by=session.rater_id)
        )

    return router
