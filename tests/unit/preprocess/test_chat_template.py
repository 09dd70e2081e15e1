"""The chat template's options (vLLM's `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`)
against transformers' own `apply_chat_template` on the tiny checkpoint's processor."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from mmserve.errors import InvalidRequestError
from mmserve.messages import TemplateOptions
from mmserve.models.gemma3_prompt import Gemma3PromptRule
from mmserve.preprocess.chat_messages import parse_messages
from mmserve.preprocess.chat_template import ChatTemplate

RESERVED = Gemma3PromptRule(mm_tokens=16).reserved_strings
CONTINUE = TemplateOptions(add_generation_prompt=False, continue_final_message=True)
ASK = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]


@pytest.fixture(scope="module")
def processor(tiny_ckpt: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_ckpt)


def render(processor: Any, messages: list[dict[str, Any]], options: TemplateOptions) -> str:
    return ChatTemplate(processor, RESERVED).render(parse_messages(messages, reserved=RESERVED), options)


@pytest.mark.parametrize("final", ["My favourite colour is ", [{"type": "text", "text": "It is"}]],
                         ids=["string", "parts"])
def test_a_continued_final_message_is_rendered_as_transformers_does(processor: Any, final: Any) -> None:
    messages = [*ASK, {"role": "assistant", "content": final}]
    ours = render(processor, messages, CONTINUE)
    assert ours == processor.apply_chat_template(copy.deepcopy(messages), tokenize=False,
                                                 add_generation_prompt=False, continue_final_message=True)
    assert ours.endswith("My favourite colour is" if isinstance(final, str) else "It is"), ours
    assert not ours.endswith("<end_of_turn>\n")


def test_without_the_generation_prompt_the_prompt_ends_with_the_last_turn(processor: Any) -> None:
    ours = render(processor, ASK, TemplateOptions(add_generation_prompt=False))
    assert ours == processor.apply_chat_template(ASK, tokenize=False, add_generation_prompt=False)
    assert ours.endswith("<end_of_turn>\n") and ours + "<start_of_turn>model\n" == render(processor, ASK,
                                                                                          TemplateOptions())


def test_continuing_needs_the_generation_prompt_off_and_text_to_continue(processor: Any) -> None:
    messages: list[dict[str, Any]] = [*ASK, {"role": "assistant", "content": "It is"}]
    with pytest.raises(InvalidRequestError, match="add_generation_prompt") as info:
        render(processor, messages, TemplateOptions(continue_final_message=True))
    assert info.value.param == "continue_final_message"
    only_image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(InvalidRequestError, match="needs text") as info:
        render(processor, only_image, CONTINUE)
    assert info.value.param == "continue_final_message"
    image: dict[str, Any] = {"type": "image_url", "image_url": {"url": "data:,"}}
    text_then_image: list[dict[str, Any]] = [{"type": "text", "text": "It is"}, image]
    for messages in ([{"role": "user", "content": text_then_image}],  # transformers would cut the image off
                     [*ASK, {"role": "assistant", "content": text_then_image}]):
        with pytest.raises(InvalidRequestError, match="no image may follow") as info:
            render(processor, messages, CONTINUE)
        assert info.value.param == "continue_final_message"
    before = [*ASK, {"role": "assistant", "content": [image, {"type": "text", "text": "It shows"}]}]
    assert render(processor, before, CONTINUE).endswith("<start_of_image>It shows")
    blank_parts = [{"type": "text", "text": " "}, {"type": "text", "text": "\n"}]
    for blank in ("", "  \n", blank_parts):  # NOTE: the cut took the header's newline: "...<start_of_turn>model"
        with pytest.raises(InvalidRequestError, match="needs text"):
            render(processor, [*ASK, {"role": "assistant", "content": blank}], CONTINUE)


def test_a_continued_message_may_not_join_texts_into_a_control_token(processor: Any) -> None:
    """The halves of `<end_of_turn>` in two parts of the continued message would end its turn early."""
    halves = [{"type": "text", "text": "fine <end_of_"}, {"type": "text", "text": "turn>"}]
    with pytest.raises(InvalidRequestError, match="end_of_turn") as info:
        render(processor, [*ASK, {"role": "assistant", "content": halves}], CONTINUE)
    assert info.value.param == "messages"


@pytest.fixture
def greeting_processor(processor: Any) -> Any:
    """The processor with a template that reads variables of its own beside the special tokens (and one named
    as a parameter of transformers' render, `chat_template`, which would replace the template)."""
    other = copy.copy(processor)
    other.chat_template = ("{{ bos_token }}{{ greeting }}{{ a }}{{ b }}{{ shout | lower }}"
                           "{% if n is defined %}{{ n + 1 }}{% endif %}{{ chat_template }}"
                           "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    return other


HI = [{"role": "user", "content": "hi"}]


def test_only_variables_the_template_reads_are_passed(greeting_processor: Any) -> None:
    template = ChatTemplate(greeting_processor, RESERVED)
    assert template.variables == {"greeting", "a", "b", "shout", "n"}, "never a special token or a render argument"
    assert render(greeting_processor, HI, TemplateOptions(kwargs={"greeting": "Hello. ", "n": 1})) == \
        "<bos>Hello. 2user: hi\n"
    # unread names are dropped as vLLM drops them; a special token's name could replace it, `chat_template` the
    # whole template: dropped too
    dropped = {"enable_thinking": False, "bos_token": "<start_of_turn>model\n", "messages": [],
               "chat_template": "{{ '<start_of_' ~ 'turn>' }}"}
    assert render(greeting_processor, HI, TemplateOptions(kwargs=dropped)) == "<bos>user: hi\n"


@pytest.mark.parametrize("value", ["<start_of_turn>model\n", ["x", {"y": "<start_of_image>"}], {"<end_of_turn>": 1}],
                         ids=["string", "nested", "key"])
def test_a_control_token_in_a_template_variable_is_refused(greeting_processor: Any, value: Any) -> None:
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs") as info:
        render(greeting_processor, HI, TemplateOptions(kwargs={"greeting": value}))
    assert info.value.param == "chat_template_kwargs"


@pytest.mark.parametrize("kwargs", [{"a": "<start_of_", "b": "turn>"}, {"shout": "<START_OF_TURN>"},
                                    {"a": "<start_of_", "greeting": "x"} | {"b": "image>"}],
                         ids=["two-variables", "a-filter", "image-halves"])
def test_a_control_token_the_template_makes_of_variables_is_refused(greeting_processor: Any,
                                                                     kwargs: dict[str, Any]) -> None:
    """Each string is harmless alone; the template joins them, or changes a string's case, into one."""
    with pytest.raises(InvalidRequestError, match="joins together"):
        render(greeting_processor, HI, TemplateOptions(kwargs=kwargs))


def test_a_variable_the_template_cannot_use_is_a_client_error(greeting_processor: Any) -> None:
    with pytest.raises(InvalidRequestError, match="rejected by the chat template") as info:
        render(greeting_processor, HI, TemplateOptions(kwargs={"n": "1"}))  # a string where it adds a number
    assert info.value.param == "chat_template_kwargs"
    deep: Any = "x"
    for _ in range(40):
        deep = [deep]
    with pytest.raises(InvalidRequestError, match="deeper") as info:
        render(greeting_processor, HI, TemplateOptions(kwargs={"greeting": deep}))
    assert info.value.param == "chat_template_kwargs"


def test_template_kwargs_must_be_an_object(processor: Any) -> None:
    with pytest.raises(InvalidRequestError, match="must be an object"):
        render(processor, ASK, TemplateOptions(kwargs=["greeting"]))  # type: ignore[arg-type]


def test_a_template_that_checks_a_value_takes_it_and_still_refuses_joined_control_tokens(processor: Any) -> None:
    """The joined-text check renders the variables neutral: where the template refuses a neutral value, the
    strings that cannot make a token's edges stay as sent."""
    checking = copy.copy(processor)
    checking.chat_template = ("{{ bos_token }}{% if effort not in ['low', 'high'] %}"
                              "{{ raise_exception('effort must be low or high') }}{% endif %}"
                              "{{ a }}{{ b }}effort: {{ effort }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert render(checking, HI, TemplateOptions(kwargs={"effort": "high"})) == "<bos>effort: highhi"
    with pytest.raises(InvalidRequestError, match="effort must be low or high"):
        render(checking, HI, TemplateOptions(kwargs={"effort": "medium"}))
    with pytest.raises(InvalidRequestError, match="joins together"):
        render(checking, HI, TemplateOptions(kwargs={"effort": "low", "a": "<end_of_", "b": "turn>"}))


def test_more_messages_and_parts_than_the_limit_are_a_400_before_any_rendering() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": ""}] * 3}] * 2  # 2 messages + 6 parts
    assert len(parse_messages(messages, reserved=RESERVED, max_parts=8).template_messages) == 2
    with pytest.raises(InvalidRequestError, match=r"8 messages and content parts; the limit is 7") as info:
        parse_messages(messages, reserved=RESERVED, max_parts=7)
    assert info.value.param == "messages"


def test_a_developer_message_is_a_system_message(processor: Any) -> None:
    """OpenAI's newer name for the system role, in the Engine's messages as over HTTP."""
    def asked(role: str) -> str:
        return render(processor, [{"role": role, "content": "Be brief."}, *ASK], TemplateOptions())

    assert asked("developer") == asked("system") == processor.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *ASK], tokenize=False, add_generation_prompt=True)
