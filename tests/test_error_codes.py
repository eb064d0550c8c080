"""One table of error codes (``tensorserve.errors.CODES``): the HTTP statuses,
the metrics' rejection reasons and the client's classes are generated from it
or held to it here. The client never imports the server, so its table is
compared with the server's, not built from it."""

from __future__ import annotations

import pytest
import tensorserve_client
import tensorserve_client.errors as client

from tensorserve import errors
from tensorserve.http.errors import STATUS
from tensorserve.metrics.requests import DISCONNECT, REJECTION_REASONS, rejection_reason

CODES = sorted(errors.CODES)


def subclasses(cls: type) -> list[type]:
    return [cls] + [sub for direct in cls.__subclasses__() for sub in subclasses(direct)]


def test_every_error_class_has_its_code_in_the_table() -> None:
    for cls in subclasses(errors.TensorServeError):
        if cls.__module__ != errors.__name__:
            continue  # a test's own subclass
        owner = errors.CODES.get(cls.code)
        assert owner is not None and issubclass(cls, owner), cls
    assert all(errors.CODES[code].code == code for code in CODES)


@pytest.mark.parametrize("code", CODES)
def test_every_code_has_a_status_and_a_code_retried_later_is_a_503(code: str) -> None:
    cls = errors.CODES[code]
    assert code in STATUS
    assert (STATUS[code] == 503) == cls.retry_later


@pytest.mark.parametrize("code", CODES)
def test_every_rejection_has_its_metrics_reason_and_nothing_else_has_one(code: str) -> None:
    cls = errors.CODES[code]
    assert REJECTION_REASONS.get(code) == cls.rejection
    assert rejection_reason(code, STATUS[code]) == cls.rejection


def test_the_metrics_count_no_code_the_table_does_not_know() -> None:
    assert set(REJECTION_REASONS) == {c for c in CODES if errors.CODES[c].rejection} | {DISCONNECT}


@pytest.mark.parametrize("code", CODES)
def test_the_client_rebuilds_every_code_into_its_own_class(code: str) -> None:
    cls, status = errors.CODES[code], STATUS[code]
    rebuilt = client.error_for(status, code, "message")
    assert type(rebuilt) is client.BY_CODE[code]
    expected = "InternalError" if cls is errors.TensorServeError else cls.__name__
    assert type(rebuilt).__name__ == expected
    assert (rebuilt.status, rebuilt.code, str(rebuilt)) == (status, code, "message")
    # The client's retry semantics are the server's.
    assert isinstance(rebuilt, client.ServerUnavailable) == cls.retry_later
    assert isinstance(rebuilt, client.BadRequest) == (400 <= status < 500)


def test_the_clients_table_is_the_servers_code_for_code_and_status_for_status() -> None:
    assert {code: status for code, (status, _) in client.CODES.items()} == {
        code: STATUS[code] for code in CODES
    }
    assert client.BY_CODE == {code: cls for code, (_, cls) in client.CODES.items()}


def test_every_code_has_a_client_class_of_its_own_that_the_package_exports() -> None:
    classes = [cls for _, cls in client.CODES.values()]
    assert len(set(classes)) == len(classes)
    assert all(getattr(tensorserve_client, cls.__name__) is cls for cls in classes)


@pytest.mark.parametrize("code", CODES)
def test_every_code_has_a_grpc_status_and_a_code_retried_later_is_unavailable(code: str) -> None:
    import grpc

    from tensorserve.grpc.errors import STATUS as GRPC_STATUS

    cls = errors.CODES[code]
    assert (GRPC_STATUS[code] is grpc.StatusCode.UNAVAILABLE) == cls.retry_later
    # INTERNAL only for faults of the server or the model, never a caller's error.
    assert (GRPC_STATUS[code] is grpc.StatusCode.INTERNAL) == (cls.rejection is None)
