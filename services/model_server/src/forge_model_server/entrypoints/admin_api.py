"""The admin HTTP API of one model server: translation only.

``POST /admin/v1/models {"name", "path", "version"?}`` serves the Hugging Face folder ``path`` (on
this machine) as ``name`` from now on; the service token is the bearer. Answers 201 with the model's
``/v1/models`` entry and its ``path`` once it is loaded, 400 naming the field for a bad name,
version or folder.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from forge_kit.http import require_token
from forge_model_server.entrypoints.openai_api import model_card
from forge_model_server.service import ModelServer


class RegisterModelBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    """What clients will put in ``model``."""
    path: str
    """Absolute path of a Hugging Face folder on this machine (config.json, tokenizer.json, weights)."""
    version: str | None = None
    """The model's version; default: the folder's ``forge_model.json``, else none."""


def install_admin_api(app: FastAPI, server: ModelServer, token: str) -> None:
    """Add ``/admin/v1/*`` behind the service token (the OpenAI error handlers come with the
    OpenAI API)."""

    async def register_model(body: RegisterModelBody) -> JSONResponse:
        info = await server.register(body.name, body.path, body.version)
        # The admin named the folder: the answer may say it (the public listing does not).
        return JSONResponse({**model_card(info, server.is_loaded(info)), "path": info.path}, status_code=201)

    app.add_api_route(
        "/admin/v1/models", register_model, methods=["POST"], dependencies=[Depends(require_token(token))]
    )
