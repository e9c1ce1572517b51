"""The engine's errors: typed, without HTTP status codes, one error body shape."""

import pytest

from ibedl.engine import errors


def all_errors() -> list[type]:
    found, todo = [], [errors.EngineError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


def test_errors_carry_type_message_field_and_no_status():
    e = errors.TooLarge("question is 5000 characters; the limit is 4000", "items.2.question")
    assert (e.type, e.message, e.field, e.retry_after) == ("too_large", str(e), "items.2.question", None)
    assert e.body() == {"error": {"type": "too_large", "message": str(e), "field": "items.2.question"}}
    assert not any(hasattr(cls, "status") for cls in all_errors())


@pytest.mark.parametrize("cls", all_errors()[1:], ids=lambda c: c.__name__)
def test_every_error_is_an_engine_error_with_its_own_type(cls):
    assert issubclass(cls, errors.EngineError) and cls.type != errors.EngineError.type


def test_an_unknown_adapter_is_an_invalid_request():
    assert issubclass(errors.UnknownAdapter, errors.InvalidRequest)
    assert errors.UnknownAdapter("no adapter 'x' is served", "adapter").type == "invalid_request"
