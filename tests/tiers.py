"""The quick tier: `./dev test --quick` runs the tests marked ``quick`` (tests/conftest.py marks what QUICK names).

Every room's happy path and its typed errors, in about 5 minutes on 2 cores: the unit tests (fakes where a GPU would
be), less the slow ones below, and one end-to-end test per door on the real demo model. tests/unit/test_quick_tier.py
checks that every module of the package is imported by at least one quick test file.
Node-id prefix -> what it covers.
"""

from __future__ import annotations

QUICK = {
    "tests/unit/": "the rooms one by one: contract, settings, wire, model directory, chat formats, backends with fakes",
    "tests/test_readme.py::test_every_example_has_a_check": "the README's and docs' examples each have a check",
    "tests/test_readme.py::test_every_relative_link": "the docs' links lead somewhere",
    "tests/test_readme.py::test_the_readme_fits": "the README's shape",
    "tests/test_readme.py::test_the_errors_the_pages_name": "every error the docs name is typed",
    "tests/test_notebooks.py::test_committed_notebooks_show_their_results": "the committed notebooks' outputs",
    "tests/test_notebooks.py::test_the_page_says_how_to_run_them": "how to run the notebooks",
    "tests/integration/test_runtime.py::test_greedy_answer_and_result_fields": "the runtime on the real model",
    "tests/integration/test_runtime.py::test_stream_chunks_concatenate_to_generate": "streaming",
    "tests/integration/test_langchain_llm.py::test_invoke_in_a_chain": "LangChain's LLM in a chain",
    "tests/integration/test_chat_model.py::test_invoke_answers_with_usage_and_metadata": "LangChain's chat model",
    "tests/integration/test_llama_index.py::test_complete_and_stream_complete": "LlamaIndex",
    "tests/integration/test_server.py::test_models_and_health": "the server up",
    "tests/integration/test_server.py::test_openai_chat_streamed_equals": "OpenAI chat through the server",
    "tests/integration/test_native.py::test_a_typed_error_in_the_servers_runtime": "typed errors across the wire",
    "tests/integration/test_native.py::test_remote_runtime_speaks_the_native_endpoint_only": "RemoteRuntime",
    "tests/integration/test_responses_api.py::test_input_items_become_one_conversation": "the Responses API",
    "tests/integration/test_embeddings.py::test_a_model_does_only_its_task": "embeddings, a task refused typed",
    "tests/integration/test_retrieval_doors.py::test_a_class_refuses_a_model": "retrieval doors, refused typed",
    "tests/integration/test_hostile_inputs_fail_typed.py::test_misspelled_arguments": "misspelled settings, typed",
    "tests/integration/test_template_sandbox.py::test_templates_people_ship_still_render": "the template sandbox",
}

NOT_QUICK = {
    "tests/unit/test_exllamav3_driver.py": "timing windows of 0.15 s and 0.3 s: runs alone (tests/conftest.py)",
    "tests/unit/test_media_budget.py": "refusals timed and the process's peak memory: runs alone",
    "tests/unit/test_streaming.py::test_a_run_of_invalid_bytes": "4000 tokens timed: runs alone",
    "tests/unit/test_model_registry.py::test_keep_alive_per_model_and_per_request": "0.6 s waits: runs alone",
    "tests/unit/test_demo_download.py::test_pip_download_logs": "a pip subprocess against a local index",
    "tests/unit/test_docs.py::test_pydoc_renders": "pydoc over every module (test_every_module_says_its_job stays)",
}
"""Prefixes inside QUICK's that stay out of the quick tier (slow, or timing-bound and run alone)."""


def is_quick(nodeid: str) -> bool:
    return any(nodeid.startswith(p) for p in QUICK) and not any(nodeid.startswith(p) for p in NOT_QUICK)
