"""What travels for an environment call: the function by reference and its arguments as
msgpack, each refused in one line saying what to do where it cannot travel."""

import array

import pytest

from flexmarl.controller.environments.references import NotSendable, decode, encode_arguments, reference


def score(text):
    return len(text)


class Env:
    def __init__(self, seed):
        self.seed = seed

    def step(self, action):
        return action

    @classmethod
    def make(cls, seed):
        return cls(seed)

    @staticmethod
    def helper():
        return 1


def test_a_module_level_function_a_class_and_its_class_and_static_methods_travel_by_name():
    assert reference(score) == (__name__, "score")
    assert reference(Env) == (__name__, "Env")
    assert reference(Env.make) == (__name__, "Env.make")
    assert reference(Env.helper) == (__name__, "Env.helper")


def test_a_lambda_a_nested_function_and_a_bound_method_are_refused_with_what_to_do():
    def inner(x):
        return x

    with pytest.raises(NotSendable, match="lambda or is defined inside a function: define it at the top level"):
        reference(lambda x: x)
    with pytest.raises(NotSendable, match="defined inside a function"):
        reference(inner)
    with pytest.raises(NotSendable, match="bound method .* keep the object in a session"):
        reference(Env(1).step)


def test_a_function_its_module_no_longer_names_is_refused():
    def replaced(text):
        return text

    replaced.__qualname__ = "score"  # claims a name its module gives another function
    with pytest.raises(NotSendable, match="does not name this function"):
        reference(replaced)


def test_arguments_round_trip_as_msgpack_values():
    payload = encode_arguments("ctx.call(score, ...)", ("a b", [1, 2], {"k": 1.5}), {"flag": True, "raw": b"\x00"})
    assert decode(payload) == [["a b", [1, 2], {"k": 1.5}], {"flag": True, "raw": b"\x00"}]


def test_an_argument_msgpack_cannot_carry_is_named_with_what_to_pass_instead():
    with pytest.raises(NotSendable, match=r"ctx.call\(score, ...\): argument 2 \(a array\) cannot be sent .* "
                                          r"list\(sample.output_ids\)"):
        encode_arguments("ctx.call(score, ...)", ("ok", array.array("i", [1])), {})
    with pytest.raises(NotSendable, match="argument env= .a Env."):
        encode_arguments("ctx.call(score, ...)", (), {"env": Env(1)})
