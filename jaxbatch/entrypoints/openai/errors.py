"""The one exception handlers raise for an HTTP error (answered with OpenAI's error body)."""
from __future__ import annotations


class APIError(Exception):
    """Answered as {"error": {...}} with this status (see app.py)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
               405: "MethodNotAllowed", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
               415: "UnsupportedMediaTypeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict | None = None):
    from fastapi.responses import JSONResponse

    from jaxbatch.entrypoints.openai import protocol as P
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, param=param, code=status,
                                             type=ERROR_TYPES.get(status, "Error")))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)
