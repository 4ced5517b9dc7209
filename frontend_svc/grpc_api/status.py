"""Errors -> gRPC statuses carrying `google.rpc.Status` details (`grpc-status-details-bin`).

- Bad input (`ValidationError`) -> INVALID_ARGUMENT + `google.rpc.BadRequest.field_violations`, one per
  violation, `field` being the dot path in the public proto.
- Retryable conditions (UNAVAILABLE, RESOURCE_EXHAUSTED) carry `google.rpc.ErrorInfo` (a stable
  `reason`, domain "tandem") and `google.rpc.RetryInfo` with a suggested delay.

`end()` sets the status a handler's call ends with when it returns; set before the handler sends
anything, gRPC answers Trailers-Only, which client retry policies can retry.
"""

from __future__ import annotations

from datetime import timedelta

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from frontend_svc.service_error import ServiceError
from shared_runtime.violations import ValidationError

DOMAIN = "tandem"
_RETRY_DELAY_S = {grpc.StatusCode.UNAVAILABLE: 1.0, grpc.StatusCode.RESOURCE_EXHAUSTED: 0.5}
_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def code_from_number(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode with this number (UNKNOWN for numbers gRPC does not define)."""
    return _CODES_BY_NUMBER.get(int(number), grpc.StatusCode.UNKNOWN)


def _pack(message: Message) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)
    return detail


def invalid_argument(error: ValidationError) -> grpc.Status:
    """INVALID_ARGUMENT with one BadRequest field violation per problem."""
    bad_request = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
        for v in error.violations
    ])
    return rpc_status.to_status(status_pb2.Status(
        code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=str(error), details=[_pack(bad_request)]))


def error_status(code: grpc.StatusCode, message: str, reason: str = "") -> grpc.Status:
    """A status with ErrorInfo(reason) and, for retryable codes, RetryInfo."""
    details = []
    if reason:
        details.append(_pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN)))
    delay = _RETRY_DELAY_S.get(code)
    if delay is not None:
        retry_delay = duration_pb2.Duration()
        retry_delay.FromTimedelta(timedelta(seconds=delay))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=retry_delay)))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=details))


def from_error(error: ValidationError | ServiceError) -> grpc.Status:
    """The status a request ending with `error` gets."""
    if isinstance(error, ValidationError):
        return invalid_argument(error)
    return error_status(code_from_number(error.code), error.message, error.reason)


def end(context: grpc.aio.ServicerContext, status: grpc.Status) -> None:
    """The status the call ends with once its handler returns (details in grpc-status-details-bin): what
    `context.abort_with_status` sends, without the exception grpc would keep in the call's state, whose
    traceback holds the handler's frames - the request - in a reference cycle until a full collection."""
    context.set_code(status.code)
    context.set_details(status.details)
    context.set_trailing_metadata(status.trailing_metadata)

