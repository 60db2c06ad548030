"""``dhp data check``: scan every configured sample once, without training, and summarise it.

Each record of each dataset is processed exactly as the loader would (images decoded and
processed, conversation rendered and tokenized, limits checked), on ``data.num_workers`` threads
(at least one); only per-sample counts are kept, so memory stays at a few samples. Audio is
counted from each clip's header (files, video audio tracks, seconds); its LLM tokens only when the
caller passes the model family's ``audio_tokens(seconds) -> int``. Bad samples are collected
whatever ``on_bad_sample`` says; the report says whether the run would fail under the configured
policy.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dhp.config.schema import DataConfig, ModelConfig
from dhp.data import bad
from dhp.data.audio import RecordAudio, record_audio
from dhp.data.batch import AUDIO
from dhp.data.processing import template_source
from dhp.data.show import describe_sample
from dhp.data.source import LlavaSource, build_source

PATCH_BINS = (0, 256, 1024, 4096, 16384, 65536)  # histogram edges of encoder patches per sample
PERCENTILES = (0, 50, 90, 99, 100)
CHUNK = 256  # samples in flight at once (bounds memory)


@dataclass
class DataReport:
    """What the check found. ``failed`` is True when a bad sample would stop a run (policy raise)."""

    num_records: int
    num_good: int
    on_bad_sample: str
    patch_histogram: dict[str, int]
    text_tokens_percentiles: dict[str, int]
    tokens_percentiles: dict[str, int]
    images_per_sample: dict[str, int]
    total_patches: int
    bad_counts: dict[str, int] = field(default_factory=dict)
    bad_examples: dict[str, list[str]] = field(default_factory=dict)
    seconds_per_sample: float = 0.0
    videos_per_sample: dict[str, int] = field(default_factory=dict)
    image_tokens: int = 0  # LLM positions holding image embeddings, all samples
    video_tokens: int = 0  # LLM positions holding video embeddings, all samples
    text_tokens: int = 0  # every other LLM position
    ignored_keys: dict[str, list[str]] = field(default_factory=dict)  # dataset -> record keys no reader uses
    shown: list[str] = field(default_factory=list)  # --show N: decoded samples (dhp.data.show)
    audios_per_sample: dict[str, int] = field(default_factory=dict)  # <audio> files per good sample
    audio_files: int = 0  # audio files of the good samples
    video_audio_tracks: int = 0  # videos whose own audio track is used (use_audio_in_video)
    audio_seconds: float = 0.0  # seconds of both, from the files' headers
    audio_tokens: int | None = None  # LLM positions of that audio (None: no family count given)

    @property
    def num_bad(self) -> int:
        return sum(self.bad_counts.values())

    @property
    def failed(self) -> bool:
        return self.num_bad > 0 and self.on_bad_sample == "raise"

    def to_json(self) -> dict:
        """The report as a JSON-able dict (what ``--json`` prints)."""
        out = asdict(self)
        out.update(num_bad=self.num_bad, failed=self.failed)
        return out


def _bin_label(lo: int, hi: int | None) -> str:
    if hi is None:
        return f">{lo}"
    return "0 (text-only)" if hi == 0 else f"{lo + 1}-{hi}"


def patch_histogram(patches: list[int]) -> dict[str, int]:
    """Counts of samples per patch bin: ``0 (text-only)``, ``1-256``, ..., ``>65536``."""
    edges = [*PATCH_BINS, None]
    bins = {_bin_label(PATCH_BINS[i - 1] if i else 0, edges[i]): 0 for i in range(len(edges))}
    for p in patches:
        for i, hi in enumerate(edges):
            if hi is None or p <= hi:
                bins[_bin_label(PATCH_BINS[i - 1] if i else 0, hi)] += 1
                break
    return bins


def percentiles(values: list[int]) -> dict[str, int]:
    """Nearest-rank percentiles ``p0, p50, p90, p99, p100`` (empty input: empty dict)."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {}
    for q in PERCENTILES:
        rank = max(1, -(-q * len(ordered) // 100))  # ceil(q/100 * n), at least 1
        out[f"p{q}"] = ordered[rank - 1]
    return out


def load_or_bad(source, index: int):
    """The sample, or its BadSampleError (the check collects bad samples instead of stopping)."""
    try:
        return source.load(index)
    except bad.BadSampleError as err:
        return err


def _load_with_audio(source, index: int):
    """``(sample, RecordAudio)``, or the BadSampleError of either. The record is read a second time
    for its audio headers (a source of real datasets only; synthetic samples hold no audio)."""
    sample = load_or_bad(source, index)
    if isinstance(sample, bad.BadSampleError) or not isinstance(source, LlavaSource):
        return sample, RecordAudio()
    d = bisect.bisect_right(source.offsets, index) - 1
    try:
        return sample, record_audio(source.datasets[d].record(index - source.offsets[d]))
    except bad.BadSampleError as err:
        return err, RecordAudio()


def audio_fields(
    per_sample: dict[str, int], clips: list[RecordAudio], *, audio_tokens: Callable[[float], int] | None
) -> dict:
    """The audio fields of a :class:`DataReport` from the good samples' :class:`RecordAudio`."""
    return {
        "audios_per_sample": dict(sorted(per_sample.items(), key=lambda kv: int(kv[0]))),
        "audio_files": sum(len(c.files) for c in clips),
        "video_audio_tracks": sum(len(c.tracks) for c in clips),
        "audio_seconds": sum(c.seconds for c in clips),
        "audio_tokens": None if audio_tokens is None else sum(c.tokens(audio_tokens) for c in clips),
    }


def check_data(
    *,
    data: DataConfig,
    model: ModelConfig,
    patch_seq_len: int,
    token_seq_len: int,
    seed: int = 0,
    on_progress=None,
    show: int = 0,
    audio_tokens: Callable[[float], int] | None = None,
    seq_lens: Mapping[str, int] | None = None,
) -> DataReport:
    """Process every record of the configured data once and return a :class:`DataReport`.
    ``on_progress(done, total)`` is called after each chunk of samples (the CLI's progress bar);
    ``show``: decode the first ``show`` good samples (roles, media, loss tokens) into ``shown``;
    ``audio_tokens(seconds)``: the model family's LLM tokens of one clip (None: not counted);
    ``seq_lens``: every module's ``seq_len``, as training bounds samples by them (``build_source``)."""
    source, _, _ = build_source(
        data=data,
        model=model,
        patch_seq_len=patch_seq_len,
        token_seq_len=token_seq_len,
        seed=seed,
        seq_lens=seq_lens,
    )
    log = bad.BadSampleLog(keep=5)
    patches, text_tokens, tokens, images, videos = [], [], [], {}, {}
    image_tok = video_tok = audio_tok = 0
    audios: dict[str, int] = {}
    clips: list[RecordAudio] = []
    shown: list[str] = []
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, data.num_workers)) as pool:
        chunks = (range(a, min(a + CHUNK, len(source))) for a in range(0, len(source), CHUNK))
        for n, (sample, clip) in enumerate(
            s for chunk in chunks for s in pool.map(lambda i: _load_with_audio(source, i), chunk)
        ):
            if on_progress is not None and ((n + 1) % CHUNK == 0 or n + 1 == len(source)):
                on_progress(n + 1, len(source))
            if isinstance(sample, bad.BadSampleError):
                log.add(sample)
                continue
            patches.append(sample.num_patches)
            tokens.append(sample.num_tokens)
            n_audio = int((sample.mm_token_type_ids == AUDIO).sum())
            audio_tok += n_audio
            text_tokens.append(
                sample.num_tokens - sample.num_image_tokens - sample.num_video_tokens - n_audio
            )
            image_tok += sample.num_image_tokens
            video_tok += sample.num_video_tokens
            n_img, n_vid = str(sample.num_images - sample.num_videos), str(sample.num_videos)
            images[n_img] = images.get(n_img, 0) + 1
            videos[n_vid] = videos.get(n_vid, 0) + 1
            audios[str(len(clip.files))] = audios.get(str(len(clip.files)), 0) + 1
            clips.append(clip)
            if len(shown) < show and hasattr(source, "processor"):
                shown.append(
                    describe_sample(
                        sample,
                        tokenizer=source.processor.tokenizer,
                        template=template_source(model.path, data.chat_template),
                        train_on=data.train_on,
                    )
                )
    elapsed = time.perf_counter() - start
    audio = audio_fields(audios, clips, audio_tokens=audio_tokens)
    if getattr(getattr(source, "processor", None), "audio", None) is not None:
        audio["audio_tokens"] = audio_tok  # the model's own count: every audio was processed
    return DataReport(
        num_records=len(source),
        num_good=len(patches),
        on_bad_sample=data.on_bad_sample,
        patch_histogram=patch_histogram(patches),
        text_tokens_percentiles=percentiles(text_tokens),
        tokens_percentiles=percentiles(tokens),
        images_per_sample=dict(sorted(images.items(), key=lambda kv: int(kv[0]))),
        total_patches=sum(patches),
        bad_counts=dict(sorted(log.counts.items())),
        bad_examples={k: log.examples[k] for k in sorted(log.examples)},
        seconds_per_sample=elapsed / max(1, len(source)),
        videos_per_sample=dict(sorted(videos.items(), key=lambda kv: int(kv[0]))),
        image_tokens=image_tok,
        video_tokens=video_tok,
        text_tokens=sum(text_tokens),
        ignored_keys={
            ds.name: sorted(ds.ignored.keys) for ds in getattr(source, "datasets", []) if ds.ignored.keys
        },
        shown=shown,
        **audio,
    )


def render_report(report: DataReport, *, console: Console) -> None:
    """Print the report as rich tables: counts, patch histogram, length percentiles, bad samples."""
    console.print(
        f"[bold]{report.num_records}[/] samples: [green]{report.num_good} good[/], "
        f"[{'red' if report.num_bad else 'green'}]{report.num_bad} bad[/] "
        f"(on_bad_sample={report.on_bad_sample})"
        + (
            f"; {report.total_patches} encoder patches in all; "
            f"{report.seconds_per_sample * 1e3:.1f} ms/sample to load and process"
            if report.patch_histogram
            else ""
        )
    )
    if not report.patch_histogram:  # the record-only check (no recipe): no token counts
        console.print("token and patch counts need the model's tokenizer: add conf=RECIPE")
    else:
        _render_tokens(report, console=console)
    imgs = ", ".join(f"{k} image(s): {v}" for k, v in report.images_per_sample.items())
    console.print(f"images per sample: {imgs}")
    vids = ", ".join(f"{k} video(s): {v}" for k, v in report.videos_per_sample.items())
    console.print(f"videos per sample: {vids}")
    if report.audio_files or report.video_audio_tracks:
        _render_audio(report, console=console)
    for name, keys in report.ignored_keys.items():
        console.print(f"dataset {escape(name)}: ignored record keys {escape(str(keys))} (not read)")
    for text in report.shown:
        console.print(escape(text), soft_wrap=True)
    if report.num_bad:
        console.print("[bold red]bad samples by reason[/] (first locations):")
        for reason, n in report.bad_counts.items():
            console.print(f"  [red]{reason}[/]: {n}")
            for example in report.bad_examples[reason]:
                console.print(f"    - {escape(example)}", soft_wrap=True)
    if report.failed:
        console.print(
            "[bold red]FAILED[/]: a run with data.on_bad_sample=raise would stop at the first bad sample. "
            "Fix the samples above, or set data.on_bad_sample=skip to skip and count them."
        )


def _render_audio(report: DataReport, *, console: Console) -> None:
    """Audio per sample and in all (seconds from the headers; tokens when the family's count was given)."""
    auds = ", ".join(f"{k} audio(s): {v}" for k, v in report.audios_per_sample.items())
    console.print(f"audio files per sample: {auds}")
    tokens = "" if report.audio_tokens is None else f", {report.audio_tokens} LLM tokens"
    console.print(
        f"audio in all: {report.audio_files} file(s) and {report.video_audio_tracks} video audio "
        f"track(s), {report.audio_seconds:.1f} s{tokens}"
    )


def _render_tokens(report: DataReport, *, console: Console) -> None:
    """The patch histogram and the token percentiles."""
    hist = Table(title="encoder patches per sample")
    hist.add_column("patches")
    hist.add_column("samples", justify="right")
    hist.add_column("")
    peak = max(report.patch_histogram.values(), default=0) or 1
    for label, n in report.patch_histogram.items():
        hist.add_row(label, str(n), "#" * round(30 * n / peak))
    console.print(hist)
    if report.num_good:
        pct = Table(title="LLM tokens per sample, percentiles")
        pct.add_column("")
        for q in report.tokens_percentiles:
            pct.add_column(q, justify="right")
        pct.add_row("text", *map(str, report.text_tokens_percentiles.values()))
        pct.add_row("text + image + video", *map(str, report.tokens_percentiles.values()))
        console.print(pct)
    console.print(
        f"LLM tokens in all: text {report.text_tokens}, image {report.image_tokens}, video {report.video_tokens}"
    )
