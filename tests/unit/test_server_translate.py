"""Request -> generation arguments, without a model or a server: every 400 the issue lists, and what is honoured."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forerun.server.schemas import ChatRequest, CompletionRequest
from forerun.server.translate import APIError, Limits, translate

LIMITS = Limits(model_name="tiny", method="auto", max_tokens_limit=64, vocab_size=1000, eos_token_ids=(2, 9))
HI = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return translate(ChatRequest(**{"messages": HI, **fields}), LIMITS)


def completion(**fields):
    return translate(CompletionRequest(**{"prompt": "Hi", **fields}), LIMITS)


@pytest.mark.parametrize(
    ("make", "fields", "param", "fragment"),
    [
        (chat, {"stop": [f"zz{i}" for i in range(5)]}, "stop", "at most 4 sequences"),
        (chat, {"stop": ["x" * 501]}, "stop", "at most 500"),
        (chat, {"stop": [""]}, "stop", "stop[0] is empty"),
        (chat, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content", "lone surrogate"),
        (completion, {"prompt": "a\udfffb"}, "prompt", "lone surrogate"),
        (chat, {"temperature": 1e-300}, "temperature", "temperature must be 0 (greedy) or between 0.0001"),
        (chat, {"temperature": 2.5}, "temperature", "between 0.0001 and 2"),
        (chat, {"temperature": float("inf")}, "temperature", "finite"),
        (chat, {"top_p": 5e-324, "repetition_penalty": 5e-324}, "repetition_penalty", "repetition_penalty must be"),
        (chat, {"top_k": 0}, "top_k", "top_k must be >= 1"),
        (chat, {"max_completion_tokens": 0}, "max_completion_tokens", "between 1 and 64"),
        (chat, {"max_tokens": 65}, "max_tokens", "between 1 and 64"),
        (chat, {"max_tokens": 10**30}, "max_tokens", "between 1 and 64"),
        (chat, {"seed": 2**64}, "seed", "seed must be between"),
        (chat, {"n": 17}, "n", "n must be between 1 and 16"),
        (chat, {"n": 0}, "n", "n must be between 1 and 16"),
        (chat, {"n": 3, "seed": 2**63 - 2}, "seed", "seed must be between 0 and 2**63 - 3"),
        (chat, {"tools": [{"type": "function"}]}, "tools", "tools are not supported"),
        (chat, {"tool_choice": "auto"}, "tool_choice", "tool_choice 'auto' needs tools"),
        (chat, {"response_format": {"type": "json"}}, "response_format", "type must be one of text, json_object"),
        (completion, {"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
        (chat, {"response_format": {"type": "json_object", "x\ud800": 1}}, "response_format", "takes no"),
        (
            completion,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["\ud800"]}}}},
            "response_format",
            "lone surrogate",
        ),
        (chat, {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "give stop_token_ids"),
        (chat, {"logit_bias": {"1000": -100}}, "logit_bias", "token ids [0, 1000), got '1000'"),
        (chat, {"logit_bias": {"-5": 1}}, "logit_bias", "token ids [0, 1000)"),
        (chat, {"logit_bias": {"a7": 1}}, "logit_bias", "token ids [0, 1000)"),
        (chat, {"logit_bias": {"٧": 1}}, "logit_bias", "token ids [0, 1000)"),  # a digit, not an ASCII one
        (chat, {"logit_bias": {"5": 100.5}}, "logit_bias", "between -100 and 100, got 100.5"),
        (chat, {"logit_bias": {"5": True}}, "logit_bias", "between -100 and 100, got True"),
        (completion, {"logit_bias": {"5": "1"}}, "logit_bias", "between -100 and 100"),
        (chat, {"logit_bias": {"5": float("nan")}}, "logit_bias", "between -100 and 100"),
        (chat, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300 tokens, got 301"),
        (chat, {"frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty must be between -2 and 2"),
        (completion, {"presence_penalty": -2.01}, "presence_penalty", "presence_penalty must be between -2 and 2"),
        (chat, {"presence_penalty": float("inf")}, "presence_penalty", "finite"),
        (chat, {"stop_token_ids": [1000]}, "stop_token_ids", "token ids [0, 1000), got 1000"),
        (completion, {"stop_token_ids": [-1]}, "stop_token_ids", "token ids [0, 1000), got -1"),
        (chat, {"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64 ids, got 65"),
        (chat, {"min_tokens": 65, "max_tokens": 64}, "min_tokens", "between 0 and max_tokens (64), got 65"),
        (completion, {"min_tokens": -1}, "min_tokens", "between 0 and max_tokens"),
        (chat, {"modalities": ["text", "audio"]}, "modalities", "only the text modality"),
        (chat, {"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
        (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
        (completion, {"logprobs": 6}, "logprobs", "between 0 and 5"),
        (completion, {"max_tokens": 0}, "max_tokens", "between 1 and"),
        (completion, {"echo": True, "max_tokens": -1}, "max_tokens", "between 0 and"),
        (completion, {"suffix": "x"}, "suffix", "suffix"),
        (completion, {"best_of": 3}, "best_of", "best_of=3"),
        (completion, {"prompt": ["a", 1]}, "prompt", "one form for all"),
        (completion, {"prompt": [1, True]}, "prompt", "one form for all"),
        (completion, {"prompt": [1, 1000]}, "prompt", "prompt[1] is token id 1000, outside the vocabulary [0, 1000)"),
        (completion, {"prompt": [[1], [-2]]}, "prompt[1]", "prompt[1][0] is token id -2"),
        (completion, {"prompt": [[1], []]}, "prompt[1]", "prompt[1] is empty"),
        (completion, {"prompt": [[1, True]]}, "prompt[0]", "item 1 is bool, not a token id"),
        (completion, {"prompt": ["a", " "]}, "prompt[1]", "prompt[1] is empty"),
        (completion, {"prompt": ["a", "b\ud800"]}, "prompt[1]", "lone surrogate"),
        (completion, {"prompt": ["a"] * 65}, "prompt", "at most 64 prompts, got 65"),
        (completion, {"prompt": "   "}, "prompt", "prompt is empty"),
        (chat, {"stream_options": {"include_usage": True}}, "stream_options", "needs stream: true"),
        (chat, {"stream": True, "stream_options": {"include_usage": "false"}}, "stream_options", "true or false"),
        (chat, {"forerun": {"method": "medusa"}}, "forerun", "unknown method 'medusa'"),
        (chat, {"forerun": {"method": "auto", "draft_len": 3}}, "forerun", "needs a method prefix"),
        (chat, {"cache_salt": ""}, "cache_salt", "1 to 256 characters, got 0"),
        (completion, {"cache_salt": "t" * 257}, "cache_salt", "1 to 256 characters, got 257"),
        (chat, {"cache_salt": "a\ud800"}, "cache_salt", "lone surrogate"),
        (chat, {"prediction": {"type": "other", "content": "x"}}, "prediction", "prediction.type"),
        (chat, {"prediction": {"type": "content", "content": [{"type": "image_url"}]}}, "prediction", "text parts"),
        (
            chat,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
            "'image_url' parts are not supported",
        ),
        (
            chat,
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0]",
            "audio",
        ),
        (chat, {"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages[0].tool_calls", "tool"),
        (chat, {"messages": [{"role": "user", "content": "  "}]}, "messages", "every message's content is empty"),
    ],
)
def test_each_refusal_is_a_400_naming_the_field(make, fields, param, fragment):
    with pytest.raises(APIError) as caught:
        make(**fields)
    assert caught.value.status == 400 and caught.value.param == param
    assert fragment in caught.value.message


def test_another_model_is_a_404():
    with pytest.raises(APIError) as caught:
        chat(model="gpt-9")
    assert caught.value.status == 404 and caught.value.kind == "not_found_error"


@pytest.mark.parametrize(
    "fields",
    [{"temperature": True}, {"max_tokens": "5"}, {"max_tokens": 5.0}, {"stream": 1}, {"temprature": 0.5}],
)
def test_strict_types_and_unknown_fields_fail_validation(fields):
    with pytest.raises(ValidationError):
        ChatRequest(**{"messages": HI, **fields})


def test_what_is_honoured():
    args = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
        ],
        max_completion_tokens=7,
        max_tokens=3,  # max_completion_tokens wins, as OpenAI
        stop="\n",
        seed=5,
        logprobs=True,
        top_logprobs=2,
        prediction={"type": "content", "content": [{"type": "text", "text": "Hello"}]},
        forerun={"method": "prompt_lookup+trie", "trie.decoding_length": 8},
        user="u1",
        cache_salt="tenant-7",
        metadata={"k": "v"},
        tool_choice="none",
        response_format={"type": "text"},
    )
    assert args.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert (args.max_new_tokens, args.stop, args.seed, args.logprobs, args.prediction) == (7, ["\n"], 5, 2, "Hello")
    assert args.method == "prompt_lookup+trie" and args.knobs == {"trie.decoding_length": 8}
    assert args.sampling == {} and args.chat and not args.stream
    assert args.cache_salt == "tenant-7" and chat().cache_salt is None
    assert args.response_format is None and args.request().response_format is None


def test_min_tokens_becomes_transformers_min_new_tokens_greedy_or_sampled():
    assert chat(min_tokens=5).request().generation == {"min_new_tokens": 5}
    assert chat(min_tokens=5, temperature=0.7).request().generation == {"min_new_tokens": 5, "temperature": 0.7}
    assert chat(min_tokens=0).request().generation == {} and chat().request().generation == {}


def test_a_json_format_reaches_the_request_for_chat_and_completions():
    for make in (chat, completion):
        args = make(response_format={"type": "json_object"})
        assert args.response_format == {"type": "json_object"} and args.request().response_format == {
            "type": "json_object"
        }


def test_logit_bias_becomes_transformers_sequence_bias_for_greedy_and_sampled_requests():
    for args in (chat(logit_bias={"5": -100, "7": 2.5}), chat(logit_bias={"5": -100, "7": 2.5}, temperature=0.7)):
        assert args.logit_bias == {5: -100.0, 7: 2.5}
        assert args.request().generation["sequence_bias"] == {(5,): -100.0, (7,): 2.5}
    assert chat().logit_bias is None and "sequence_bias" not in chat(logit_bias={}).request().generation


def test_sampled_choices_are_seeded_one_after_another_and_greedy_ones_are_written_once():
    sampled = chat(n=3, seed=7, temperature=0.8)
    assert (sampled.n, sampled.runs) == (3, 3)
    assert [sampled.request(choice=i).seed for i in range(3)] == [7, 8, 9]  # choice i: what seed 7 + i writes alone
    assert chat(n=2, temperature=0.8).request(choice=1).seed is None  # unseeded: each choice draws its own
    greedy = chat(n=3, temperature=0, seed=7)
    assert (greedy.n, greedy.runs) == (3, 1)  # the same text for each choice
    assert (chat().n, chat().runs) == (1, 1)


def test_sampling_follows_the_request_then_the_models_generation_config():
    assert chat().sampling == {}  # no defaults: greedy
    assert chat(temperature=0).sampling == {}
    assert chat(temperature=0.7, top_p=0.9).sampling == {"temperature": 0.7, "top_p": 0.9, "do_sample": True}
    assert chat(top_p=0.5).sampling == {"top_p": 0.5, "do_sample": True}  # OpenAI's temperature 1
    assert chat(repetition_penalty=1.2).sampling == {"repetition_penalty": 1.2}  # greedy with a penalty
    assert chat(frequency_penalty=0.5, presence_penalty=0).sampling == {"frequency_penalty": 0.5}  # 0: none
    penalised = chat(temperature=0.7, presence_penalty=-1).request()
    assert penalised.presence_penalty == -1 and penalised.do_sample and penalised.generation == {"temperature": 0.7}
    sampling_model = Limits(model_name="tiny", sampling_defaults={"do_sample": True, "temperature": 0.6, "top_p": 0.95})
    body = ChatRequest(messages=HI)
    assert translate(body, sampling_model).sampling == {"temperature": 0.6, "top_p": 0.95, "do_sample": True}
    body = ChatRequest(messages=HI, temperature=0)
    assert translate(body, sampling_model).sampling == {}


def test_an_operator_limits_which_methods_requests_may_pick():
    import dataclasses

    closed = dataclasses.replace(LIMITS, method="prompt_lookup", request_methods=())
    ask = lambda method: translate(ChatRequest(messages=HI, forerun={"method": method}), closed)  # noqa: E731
    assert ask("prompt_lookup").method == "prompt_lookup" and ask("plain").method == "plain"
    for method in ("trie", "auto", "jacobi"):
        with pytest.raises(APIError, match=f"method '{method}' is not enabled on this server") as caught:
            ask(method)
        assert caught.value.param == "forerun" and caught.value.status == 400
    some = dataclasses.replace(closed, request_methods=("trie",))
    assert translate(ChatRequest(messages=HI, forerun={"method": "trie"}), some).method == "trie"
    assert translate(ChatRequest(messages=HI, forerun={"method": "auto"}), LIMITS).method == "auto"  # None: any


def test_an_operator_list_admits_auto_by_name_or_by_its_parts_and_a_servers_head_is_not_the_requests_pick():
    """'--request-methods auto' admits 'auto'; so does listing the three methods it stands for, also on a server
    with a head (which 'auto' then drafts with: the operator's head, not a method the request picked). 'eagle3'
    named by a request is a pick of its own and needs listing."""
    import dataclasses

    ask = lambda method, limits: translate(ChatRequest(messages=HI, forerun={"method": method}), limits)  # noqa: E731
    by_name = dataclasses.replace(LIMITS, method="prompt_lookup", request_methods=("auto",))
    assert ask("auto", by_name).method == "auto"
    for method in ("trie", "auto+eagle3"):
        with pytest.raises(APIError, match="not enabled on this server"):
            ask(method, by_name)
    by_parts = dataclasses.replace(by_name, request_methods=("prompt_lookup", "trie", "jacobi"), head=True)
    assert ask("auto", by_parts).method == "auto" and ask("trie", by_parts).method == "trie"
    with pytest.raises(APIError, match="not enabled on this server"):
        ask("eagle3", by_parts)


def test_request_methods_on_the_command_line():
    from forerun.cli import parse_request_methods

    assert parse_request_methods("any") is None and parse_request_methods("none") == ()
    assert parse_request_methods("trie, prompt_lookup") == ("trie", "prompt_lookup")
    with pytest.raises(ValueError, match="unknown method"):
        parse_request_methods("trie,magic")


def test_the_schema_refuses_what_the_server_refuses():
    """The published schema admits no body that translation then refuses for its shape."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="prompt is empty"):
        CompletionRequest(prompt="")
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=[])


def test_serve_max_tree_nodes_caps_what_every_decoder_feeds():
    """`forerun serve --max-tree-nodes N` reaches the server's Decoders (it was accepted, then dropped)."""
    from forerun.server.decoders import DecoderPool

    from tiny_models import prompts, tiny_model

    model = tiny_model("llama")
    capped, free = (
        DecoderPool(model, None, "prompt_lookup", {}, max_tree_nodes=2),
        DecoderPool(model, None, "prompt_lookup", {}),
    )
    prompt = prompts(1)[0]
    fed = {}
    for name, pool in (("capped", capped), ("free", free)):
        decoder = pool.get("prompt_lookup", {"draft_len": 6})
        result = decoder.generate(prompt, 24, eos_token_id=[])
        fed[name] = max(result.stats.fed_hist)
    assert fed["capped"] <= 2 < fed["free"]


def test_vllms_ignore_eos_and_stop_token_ids_set_the_ids_that_end_the_answer():
    assert chat().request().eos_token_id is None  # the model's own, as the Decoder reads them
    assert chat(stop_token_ids=[]).request().eos_token_id is None
    assert chat(ignore_eos=False).request().eos_token_id is None
    assert chat(ignore_eos=True).request().eos_token_id == ()  # none: the answer runs to max_tokens or a stop
    assert completion(stop_token_ids=[7, 9]).request().eos_token_id == (2, 7, 9)  # besides the model's own
    assert chat(ignore_eos=True, stop_token_ids=[7]).request().eos_token_id == (7,)
    with pytest.raises(ValidationError):
        ChatRequest(messages=HI, ignore_eos="yes")  # strict: a string is no boolean
    with pytest.raises(ValidationError):
        ChatRequest(messages=HI, stop_token_ids=[True])


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Hi", ["Hi"]),
        (["Hi", "Bye"], ["Hi", "Bye"]),
        ([5, 7, 999], [[5, 7, 999]]),
        ([[5], [0, 1]], [[5], [0, 1]]),
    ],
)
def test_a_completions_prompt_takes_openais_four_forms(prompt, expected):
    args = completion(prompt=prompt, n=2)
    assert list(args.prompts) == expected and args.prompt == expected[0]
    each = args.each()
    assert [a.prompt for a in each] == expected and all(a.n == 2 and a.prompts == (a.prompt,) for a in each)


def test_echo_takes_max_tokens_0_and_then_generates_nothing():
    echoed = completion(echo=True, max_tokens=0, logprobs=2)
    assert echoed.echo and echoed.max_new_tokens == 0 and echoed.runs == 0 and echoed.logprobs == 2
    assert completion(echo=True, n=3).runs == 1 and completion(echo=True, n=3, temperature=1.0).runs == 3
    assert not completion().echo


def test_template_variables_and_reasoning_effort_reach_the_template_only_where_it_reads_them():
    """`chat_template_kwargs` names variables the template reads (a 400 naming any other); `reasoning_effort` is
    given to a template that reads one (gpt-oss's), as vLLM gives it, and refused by name where it reads none."""

    def body(**fields) -> ChatRequest:
        return ChatRequest(messages=HI, **fields)

    reads = Limits(model_name="m", template_variables=frozenset({"enable_thinking", "reasoning_effort"}))
    args = translate(body(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="low"), reads)
    assert args.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert args.request().chat_template_kwargs == args.chat_template_kwargs
    assert translate(body(), reads).chat_template_kwargs is None
    for fields, param, fragment in (
        ({"chat_template_kwargs": {"enable_thinkng": False}}, "chat_template_kwargs", "'enable_thinkng' is not"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools' is not a variable"),
        ({"reasoning_effort": "max"}, "reasoning_effort", "must be one of none, minimal"),
        ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort",
         "differs"),
    ):  # fmt: skip
        with pytest.raises(APIError) as refused:
            translate(body(**fields), reads)
        assert refused.value.param == param and fragment in refused.value.message, refused.value.message
    with pytest.raises(APIError) as refused:
        translate(body(reasoning_effort="low"), Limits(model_name="m"))
    assert refused.value.param == "reasoning_effort" and "reads no reasoning_effort" in refused.value.message


def test_the_servers_template_variables_stand_unless_a_request_sets_its_own():
    defaults = {"enable_thinking": False, "reasoning_effort": "high"}
    limits = Limits(model_name="m", template_variables=frozenset(defaults), template_defaults=defaults)
    assert translate(ChatRequest(messages=HI), limits).chat_template_kwargs == defaults
    own = ChatRequest(messages=HI, chat_template_kwargs={"enable_thinking": True}, reasoning_effort="low")
    assert translate(own, limits).chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}


def test_developer_messages_are_system_ones_unless_the_template_names_the_role():
    """OpenAI's developer role (Codex sends its instructions so): a system message for a template that does not
    name it (most refuse or drop an unknown role), the leading ones one message; passed on to one that does."""
    from forerun.server.messages import takes_developer

    sent = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use French."}, *HI,
            {"role": "developer", "content": "Now English."}]  # fmt: skip
    assert chat(messages=sent).prompt == [
        {"role": "system", "content": "Be brief.\n\nUse French."},
        *HI,
        {"role": "system", "content": "Now English."},
    ]
    assert chat(messages=[sent[0], *HI]).prompt == [sent[0], *HI]  # no developer: nothing merged
    named = Limits(model_name="tiny", developer=True)
    assert translate(ChatRequest(messages=sent), named).prompt == sent

    class Tokenizer:
        chat_template = {"default": "{{ messages }}", "tool_use": "{% if m.role == 'developer' %}{% endif %}"}

    assert takes_developer(Tokenizer()) and not takes_developer(type("T", (), {"chat_template": "{{ x }}"})())


def test_continuing_the_last_message_is_checked_by_name():
    """vLLM's `continue_final_message`: the last message must be an assistant's text; with
    `add_generation_prompt` true too, or `add_generation_prompt` false alone, a 400 names the field."""
    said = [*HI, {"role": "assistant", "content": "Hello"}]
    assert chat(messages=said, continue_final_message=True).continued
    assert not chat(messages=said).continued
    for fields, param in (({"continue_final_message": True}, "continue_final_message"),
                          ({"messages": said, "continue_final_message": True, "add_generation_prompt": True},
                           "add_generation_prompt"),
                          ({"messages": said, "add_generation_prompt": False}, "add_generation_prompt")):  # fmt: skip
        with pytest.raises(APIError) as refused:
            chat(**fields)
        assert refused.value.param == param


def test_a_suffix_is_a_fill_in_the_middle_prompt_where_the_tokenizer_has_the_marks():
    """OpenAI's `suffix`: with the tokenizer's fill-in-the-middle marks, the prompt is prefix, suffix, middle in
    those marks; one text prompt only, no echo; refused by name where the tokenizer has no such marks."""
    from forerun.fim import FORMS

    fim = Limits(model_name="tiny", max_tokens_limit=64, fim=FORMS[0])
    args = translate(CompletionRequest(prompt="def f():\n    return ", suffix="\n\nf()"), fim)
    assert args.prompt == "<|fim_prefix|>def f():\n    return <|fim_suffix|>\n\nf()<|fim_middle|>"
    for fields, param in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 2]}, "prompt"),
                          ({"echo": True}, "echo"), ({"suffix": "\udc00"}, "suffix")):  # fmt: skip
        with pytest.raises(APIError) as refused:
            translate(CompletionRequest(**{"prompt": "x", "suffix": "y", **fields}), fim)
        assert refused.value.param == param
