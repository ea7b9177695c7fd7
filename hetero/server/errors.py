"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every failure."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("hetero.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: Optional[str] = None
    code: Optional[str] = None

    def body(self) -> dict[str, Any]:
        return error_body(self.message, _TYPE_BY_STATUS.get(self.status, "invalid_request_error"), self.param, self.code)


def error_body(message: str, type_: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The first pydantic error as a 400 naming the offending field."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": ""}
    if first.get("type") == "json_invalid":
        return malformed_json(first.get("ctx", {}).get("error", first["msg"]))
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = ".".join(loc) or None
    kind = first.get("type")
    if field is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {field!r}", param=field)
    if kind == "missing":
        return APIError(400, f"{field} is required", param=field)
    message = first["msg"].removeprefix("Value error, ")
    return APIError(400, f"{field}: {message}" if field else message, param=field)


def malformed_json(detail: str) -> APIError:
    return APIError(400, f"malformed JSON body: {detail}", code="invalid_json")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return JSONResponse(error_body(f"internal server error: {exc!r}", "server_error"), status_code=500)
