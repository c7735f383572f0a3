"""Errors as OpenAI's API writes them: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, hint: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = f"{message} ({hint})" if hint else message
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
