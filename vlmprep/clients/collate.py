"""Collate client samples (dicts from vlmprep.clients.wds or .hf) -> the batch an HF model takes:
input_ids, labels, attention_mask, position_ids, mm_token_type_ids, pixel_values, image_grid_thw,
pixel_values_videos, video_grid_thw, second_per_grid_ts (Qwen2.5-VL) (torch tensors); with `trained_logits=True`
also logits_to_keep and shift_labels, so the model computes logits only where the next token is trained.

    collator = vlmprep.clients.collate.Collator(DIR)  # a dataset dir, or its processor dir
    batch = collator([sample, ...])

Pixels come from the dataset's saved processor (DIR/processor) itself: stored images with resizing off (they are
stored already resized), source pixels (`img*.orig.*`: photos the default `auto` keeps, or `--image-format original`)
first resized by the build's own rule (vlmprep_schemas.resize), as the trainer does; video frames with its video
processor, neither sampled nor resized again (they are stored so).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlmprep.families import family_of
from vlmprep.pixels import merged_patch
from vlmprep.shards.dataset import MANIFEST_NAME
from vlmprep.shards.manifest import open_dataset, processor_dir
from vlmprep_schemas.limits import grid_problem
from vlmprep_schemas.pixels import RULES, pixel_inputs
from vlmprep_schemas.resize import original_mode, resize_mode, stored_pixels
from vlmprep_schemas.versions import split_ref

IGNORE_INDEX = -100  # labels where loss_mask is 0 or padding: torch cross_entropy's default ignore_index, as HF uses


class Collator:
    """Right-padded batch of client samples, usable as-is as the `collate_fn` of a torch DataLoader or the
    `data_collator` of HF `Trainer` / TRL `SFTTrainer` (settings: docs/other-libraries.md).

    Args:
        path: a vlmprep dataset dir (DIR, or a version of it: DIR@vN, DIR@TAG), or its saved processor dir.
        pad_token_id: the id padding gets (default: the tokenizer's pad id, else 0); padding is never trained.
        trained_logits: also give `logits_to_keep` (bool [B, L]: True where the next token is trained) and
            `shift_labels` (those next tokens, int64 [N]). An HF model then projects only those N positions through
            its LM head, and its loss is the mean over them, as `python -m trainer` computes it: logits of N x vocab
            instead of B x L x vocab, the same loss. HF `Trainer` counts the loss's tokens from `shift_labels`
            (gradient accumulation and multi-GPU normalize by the global count). Off by default, because with it
            `outputs.logits` is [N, vocab], not [B, L, vocab], and TRL's `SFTTrainer` fails on these keys (its
            fused LM head scores only the trained positions itself and reads `shift_labels` as [B, L]).
    """

    def __init__(self, path: str | Path, *, pad_token_id: int | None = None, trained_logits: bool = False):
        value = str(path)
        base, ref = split_ref(value)
        path = Path(base)
        self.image_format = None
        if ref is not None or (path / MANIFEST_NAME).is_file():  # DIR, DIR@vN or DIR@TAG
            path, manifest = open_dataset(value)  # every path it names checked to stay inside the dataset
            self.image_format = manifest.image_format
            path = processor_dir(path, manifest)
        if not any((path / n).is_file() for n in ("processor_config.json", "preprocessor_config.json")):
            raise ValueError(f"{path}: neither a vlmprep dataset dir nor a saved processor dir")
        self.processor_dir = str(path)
        self._pad_token_id = pad_token_id
        self.trained_logits = trained_logits
        self._processor = None

    def __getstate__(self) -> dict:  # DataLoader workers (spawn) load the processor themselves
        return {**self.__dict__, "_processor": None}

    @property
    def processor(self):
        """The dataset's saved processor (e.g. TRL's `processing_class`); loaded locally, never from a hub, never its
        custom code (a processor whose configs carry `auto_map` is refused in one line)."""
        if self._processor is None:
            from vlmprep.processors.load import load_saved_processor

            self._processor = load_saved_processor(self.processor_dir)
        return self._processor

    def _resizes(self, sample: dict) -> list[bool]:
        """Per occurrence: does the processor still resize it? Families stored as source (tiling processors) yes;
        every other stored image holds exactly the resized pixels already (source pixels too, once _resized)."""
        family = family_of(type(self.processor).__name__)
        return [family is not None and family.image_mode == "source"] * len(sample["images"])

    def _sources(self, sample: dict) -> list[bool]:
        """Per occurrence: does the sample hold its source pixels (an `img*.orig.*` member) rather than stored ones?"""
        members = [im.get("member", "") for im in (sample.get("meta") or {}).get("images", [])]
        if len(members) == len(sample["images"]):
            return [".orig." in m for m in members]
        if self.image_format == "auto":
            raise ValueError(
                f"{self.processor_dir}: sample {sample.get('id', '?')} has no meta: an auto dataset's images are "
                "stored per image, so the collator needs each sample's meta (the client readers give it)"
            )
        return [self.image_format == "original"] * len(sample["images"])  # no meta: the manifest's format says

    def _resized(self, sample: dict) -> dict:
        """The sample with each source image (`img*.orig.*`) made into the pixels the build stored for it: the
        processor's own RGB conversion and resize, by the rule the build and the trainer run
        (vlmprep_schemas.resize), so a batch's images are all stored pixels whatever their storage."""
        sources = self._sources(sample)
        if not any(sources):
            return sample
        from PIL import Image

        ip = self.processor.image_processor
        mode, patch = resize_mode(type(ip).__name__), merged_patch(self.processor)
        metas = (sample.get("meta") or {}).get("images", [])
        stored = [(m.get("height"), m.get("width")) for m in metas] if len(metas) == len(sources) else []
        made: dict[int, np.ndarray] = {}  # a repeated image (one array) resized once
        for im, source, size in zip(sample["images"], sources, stored or [None] * len(sources)):
            if source and id(im) not in made:
                pixels = np.asarray(im)
                how = original_mode(mode, size, pixels.shape[:2])  # a tiling processor's source stays one
                made[id(im)] = stored_pixels(ip, how, Image.fromarray(pixels, "RGB"), patch)
        return {**sample, "images": [made.get(id(im), im) for im in sample["images"]]}

    def _check_sizes(self, samples: list[dict]) -> None:
        """Each stored image's size against its grid row on the processor's patches (1 where the family's grid rows
        are the size), the trainer's check, before the processor sees a pixel; source pixels (the processor resizes
        them) are bounded by the reader's limits instead. ValueError, one line naming the sample and image."""
        family = family_of(type(self.processor).__name__)
        patch = (
            1
            if family is not None and not family.grid_images
            else (getattr(self.processor.image_processor, "patch_size", None))
        )
        if not isinstance(patch, int):  # a processor that names no patch size: its own grids are compared below
            return
        for s in samples:
            grids = np.asarray(s["image_grid_thw"]).reshape(-1, 3)
            for k, (image, resize) in enumerate(zip(s["images"], self._resizes(s))):
                problem = (
                    "has no grid row"
                    if k >= len(grids)
                    else None
                    if resize
                    else grid_problem(*np.shape(image)[:2], grids[k], patch)
                )
                if problem:
                    raise ValueError(
                        f"{self.processor_dir}: sample {s.get('id', '?')}: image {k} {problem}: not the "
                        "processor these samples were built with, or a corrupt sample"
                    )

    def _family_pixels(self, samples: list[dict], rule, ids, mm) -> dict:
        """A family whose pixel inputs are not a grid's (Llama, Gemma, Mistral, InternVL, LLaVA-OneVision, SmolVLM,
        GLM-4.1V): the processor's own batch call on each sample's images, by the rule the trainer shares
        (vlmprep_schemas.pixels), with the family's extras (token types, cross-attention mask)."""
        resize = {r for s in samples for r in self._resizes(s)}
        assert len(resize) <= 1, "a batch mixes stored and source images"
        proc = self.processor
        return pixel_inputs(
            proc.image_processor,
            rule,
            [list(s["images"]) for s in samples],
            resize=resize == {True},
            ids=ids,
            mm=mm,
            image_token_id=int(getattr(proc, "image_token_id", -1) or -1),
            max_tiles=int(getattr(proc.image_processor, "max_image_tiles", 0) or 0),
        )

    def _pixels(self, samples: list[dict]) -> dict:
        """The image processor's outputs for every occurrence in token order, concatenated (one call per unique
        image: a repeated screenshot is shared by the client readers and computed once)."""
        import torch

        ip = self.processor.image_processor
        parts: list[dict] = []
        done: dict[tuple[int, bool], dict] = {}
        for s in samples:
            for image, resize in zip(s["images"], self._resizes(s)):
                key = (id(image), resize)
                if key not in done:
                    done[key] = ip(images=[np.asarray(image)], do_resize=resize, return_tensors="pt")
                parts.append(done[key])
        if not parts:
            return {}
        out = {k: torch.cat([p[k] for p in parts]) for k in parts[0].keys()}
        if "image_grid_thw" in out:
            self._check_grids("image", out["image_grid_thw"], samples)
        return out

    def _check_grids(self, kind: str, made, samples: list[dict]) -> None:
        """Refuse a processor whose `kind` grids differ from the ones the samples store (built with another)."""
        import torch

        stored = torch.from_numpy(
            np.concatenate([np.asarray(s[f"{kind}_grid_thw"]).reshape(-1, 3) for s in samples]).astype(np.int64)
        )
        if not torch.equal(made, stored):
            raise ValueError(
                f"{self.processor_dir} makes {kind} grids {made.tolist()}, the samples "
                f"store {stored.tolist()}: not the processor these samples were built with"
            )

    def _video_pixels(self, samples: list[dict]) -> dict:
        """The video processor's pixel_values_videos and video_grid_thw of every video in token order, from the stored
        frames, and the stored second_per_grid_ts where the processor lists it as a model input (Qwen2.5-VL)."""
        import torch

        videos = [np.asarray(v) for s in samples for v in s.get("videos") or ()]
        if not videos:
            return {}
        vp = getattr(self.processor, "video_processor", None)
        if vp is None:
            raise ValueError(f"{self.processor_dir} holds no video processor, but the samples hold videos")
        # Resize is off, so the per-frame cap changes nothing; naming it (as the build did) silences its warning.
        cap = {"cap_pixels_per_frame": bool(vp.cap_pixels_per_frame)} if hasattr(vp, "cap_pixels_per_frame") else {}
        made = vp(videos=videos, do_resize=False, do_sample_frames=False, return_tensors="pt", **cap)
        out = {"pixel_values_videos": made["pixel_values_videos"], "video_grid_thw": made["video_grid_thw"]}
        with_videos = [s for s in samples if s.get("videos")]
        self._check_grids("video", out["video_grid_thw"], with_videos)
        if "second_per_grid_ts" in getattr(self.processor, "model_input_names", ()):
            out["second_per_grid_ts"] = torch.from_numpy(
                np.concatenate([np.asarray(s["second_per_grid_ts"], dtype=np.float32).reshape(-1) for s in with_videos])
            )
        return out

    def __call__(self, samples: list[dict]) -> dict:
        """Client samples (dicts from vlmprep.clients.wds or .hf) -> one padded batch of torch tensors, the dict an
        HF model takes (input_ids, labels, attention_mask, position ids, pixel values and grids); refuses samples
        another processor built (its video grids differ from the stored ones) as a ValueError."""
        import torch

        proc = self.processor
        pad = self._pad_token_id
        if pad is None:
            pad = getattr(getattr(proc, "tokenizer", None), "pad_token_id", None) or 0
        ids = [np.asarray(s["input_ids"]).astype(np.int64) for s in samples]
        B, L = len(ids), max(len(x) for x in ids)
        batch = {
            "input_ids": torch.full((B, L), pad, dtype=torch.long),
            "labels": torch.full((B, L), IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.zeros((B, L), dtype=torch.long),
            "mm_token_type_ids": torch.zeros((B, L), dtype=torch.long),
        }
        positions = torch.zeros((3, B, L), dtype=torch.long)
        for b, (s, x) in enumerate(zip(samples, ids)):
            n, t = len(x), torch.from_numpy(x)
            batch["input_ids"][b, :n] = t
            batch["labels"][b, :n] = torch.where(torch.from_numpy(np.asarray(s["loss_mask"]) != 0), t, IGNORE_INDEX)
            batch["attention_mask"][b, :n] = 1
            batch["mm_token_type_ids"][b, :n] = torch.from_numpy(np.asarray(s["mm_token_type_ids"]).astype(np.int64))
            positions[:, b, :n] = torch.from_numpy(np.asarray(s["position_ids"]).astype(np.int64))
        samples = [self._resized(s) for s in samples]
        self._check_sizes(samples)
        family = family_of(type(proc).__name__)
        # MRoPE models take the stored [3, B, L] ids (their get_rope_index); 1-D rope models the text row.
        batch["position_ids"] = positions if family is not None and family.positions == "mrope" else positions[0]
        rule = RULES.get(type(proc).__name__)
        if rule is not None:
            batch.update(
                self._family_pixels(samples, rule, batch["input_ids"].numpy(), batch["mm_token_type_ids"].numpy())
            )
        if "mm_token_type_ids" not in getattr(proc, "model_input_names", ()):
            del batch["mm_token_type_ids"]
        if self.trained_logits:  # the trainer's own selection (trainer/model.py forward_loss)
            keep = torch.zeros((B, L), dtype=torch.bool)
            keep[:, :-1] = batch["labels"][:, 1:] != IGNORE_INDEX
            batch["logits_to_keep"] = keep
            batch["shift_labels"] = batch["labels"][:, 1:][keep[:, :-1]]
        if rule is None:
            batch.update(self._pixels(samples))
        batch.update(self._video_pixels(samples))
        return batch
