"""The registry of reject reasons: every reason code a bad record can get, with its stage and what it means.
RecordError refuses a reason not listed here; docs/rejects.md's table is generated from it (reasons_table)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    """One registered reject reason: the stage that raises it (its docs/rejects.md row) and its help text."""

    stage: str  # the docs/rejects.md table's row
    help: str = ""  # printed in parentheses after the code; "" for a self-explaining code


def _stage(stage: str, **reasons: str) -> dict[str, Reason]:
    return {name: Reason(stage, text) for name, text in reasons.items()}


# In docs/rejects.md order: the table lists the stages and, in each, the reasons as written here.
REASONS: dict[str, Reason] = {
    **_stage(
        "reading",
        invalid_json="",
        json_too_deep="`--max-json-depth`, default 64: [ and { nesting of a line, a `.json` file's records, a JSON"
        " string column or tool-call arguments, found as it is parsed, before any stage recurses over it",
        invalid_json_file="unparsable, or not an array of records / one record",
        invalid_utf8="",
        not_an_object="",
        line_too_long="`--max-line-bytes`",
        corrupt_zstd_stream="earlier lines kept; names the byte and frame, counts `unread_bytes`",
        zstd_window_too_large="`--max-zstd-window`",
        empty_file="also a `.json` holding `[]`, a table with no rows",
        read_error="",
        unreadable_table="a Parquet or Arrow file that cannot be read, or fails mid-way: earlier rows kept",
        duplicate_id="",
    ),
    **_stage(
        "record shape",
        missing_messages="",
        too_many_messages="`--max-messages-per-record`, default 10000; a table's message lists are counted before"
        " the row is converted",
        unknown_layout="a table row with none of the columns of a layout vlmprep reads: names the columns found",
        invalid_message="",
        unknown_role="",
        no_assistant_turn="",
        empty_assistant_turn="no content, tool_calls, function_call or refusal",
        invalid_content="",
        invalid_content_part="",
        unknown_content_type="",
        unsupported_audio="",
        invalid_text="",
        invalid_unicode="a lone surrogate, valid JSON as `\\udc00`, in any string or key of the record; names the first"
        " such field, e.g. `id` or `messages[2].tool_calls[0].function.name`",
        invalid_id="an `id` neither a string nor an integer",
        invalid_weight="",
        invalid_reasoning="not a string, two differing fields, on a non-assistant message",
        invalid_tools="",
        invalid_tool_call="also a malformed legacy `function_call`",
        invalid_tool_arguments="",
    ),
    **_stage(
        "image references",
        invalid_image_ref="also a path holding NUL",
        unsupported_file_id="an image given by OpenAI / Anthropic Files API `file_id`",
        unsupported_image_source="an Anthropic image `source` other than base64 or url",
        invalid_images_field="",
        unsupported_image_url="",
        invalid_data_uri="",
        invalid_base64="",
        image_not_found="",
        path_outside_root="`--image-root`",
        remote_image_refused="`--allow-remote`",
        remote_fetch_failed="",
        image_file_too_large="`--max-image-bytes`, local files and `--allow-remote` fetches alike",
        image_count_mismatch="ShareGPT / LLaMA-Factory layout: `<image>` markers and images differ in number; or"
        " the template drops a message's images, e.g. Qwen3-VL's in assistant turns, or Llama 4's Hub"
        " template a user message's beside tools: names the message and a bundled template of the family"
        " that renders them, where one does",
        too_many_images="`--max-images-per-record`",
    ),
    **_stage(
        "video",
        unsupported_video="a family without video support",
        invalid_videos_field="ShareGPT / LLaMA-Factory layout: `videos` not a list",
        invalid_video_option="fps, max_frames, pixels not positive",
        invalid_video_ref="",
        unsupported_video_url="",
        remote_video_refused="videos are local or data URIs only",
        video_not_found="",
        video_unreadable="also a directory, device or FIFO named as the video",
        video_file_too_large="`--max-video-bytes`: a video file is read whole",
        corrupt_video="undecodable, or truncated: fewer frames decode than it declares; re-encode it",
        unsupported_video_codec="no decoder for its codec: re-encode to H.264, VP9 or AV1",
        video_no_frames="an empty frame list or a container without frames",
        video_too_short="fewer frames than the temporal patch, 2",
        video_frame_size_mismatch="a frame list of several sizes",
        video_too_large="frames over `--max-image-pixels`",
        video_too_small="frames with a side under `--min-image-side`, as images",
        raw_video_stream="an elementary stream with no container, e.g. `.h264`: no frame times, its rate unknown; wrap"
        " it in MP4 at its real rate",
        video_too_long="its tokens alone exceed `--seq-len` even at the sampled frames, before the first answer: lower"
        " fps / max_frames / max_pixels; a later one costs only its turn, as an image",
        video_count_mismatch="ShareGPT / LLaMA-Factory layout: `<video>` markers and `videos` differ in number; or"
        " the template drops a video, e.g. in an assistant turn",
    ),
    **_stage(
        "image content",
        image_unreadable="also a directory, device or FIFO named as the image",
        corrupt_image="also formats PIL cannot identify, e.g. SVG",
        unsupported_image_mode="integer or float pixels beyond 16-bit / 0..1",
        image_too_large="`--max-image-pixels`, decompression bombs",
        image_too_small="`--min-image-side`",
        bad_aspect_ratio="",
        animated_image="not MPO: its first picture is used",
    ),
    **_stage(
        "render and mask",
        template_refused="the chat template raised on the conversation, e.g. Gemma 3's roles that do not alternate"
        " (a tool turn) or Llama 3.2 Vision's system message beside an image",
        special_token_in_text="",
        sentinel_in_text="",
        template_not_verbatim="",
        tool_calls_not_rendered="",
        reasoning_not_rendered="",
        reasoning_refused="`--reasoning reject`",
        end_of_turn_not_found="",
        image_wrapper_missing="",
        role_boundary_mismatch="",
        mask_boundary_misaligned="",
        mask_verification_failed="",
        no_trainable_tokens="",
    ),
    **_stage(
        "truncation",
        no_trainable_tokens_after_truncation="",
        turn_too_long="with `--long-traces split`: one line per turn that cannot fit; the record's other turns land",
    ),
    **_stage(
        "anything else",
        internal_error="an unexpected exception while handling this one record, a vlmprep bug: please report it with"
        " the record; the record is rejected and the build goes on",
    ),
}


def reasons_table() -> str:
    """docs/rejects.md's table (tests/test_readme.py compares): one row per stage, its reasons in order."""
    rows = ["| stage | reasons |", "| --- | --- |"]
    for stage in dict.fromkeys(r.stage for r in REASONS.values()):
        cells = [f"`{name}`" + (f" ({r.help})" if r.help else "") for name, r in REASONS.items() if r.stage == stage]
        rows.append(f"| {stage} | {', '.join(cells)} |")
    return "\n".join(rows) + "\n"
