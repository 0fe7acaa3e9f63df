"""MP4 encoding and seek-based decoding with PyAV for LeRobot v3.0 ``video`` features.

In v3.0 several episodes share one video file: an episode's frames start at its ``from_timestamp``
in that file, so frame ``t`` of an episode sits at ``from_timestamp + timestamp[t]``.

Accuracy: frames come back exactly at the requested presentation time (within ``tolerance_s``),
but their pixels are lossy. With the encoder settings below and smooth content, decoded RGB
values differ from the source by a mean absolute error of a few levels out of 255 (the
round-trip test bounds it); noise-like images lose more.
"""

from __future__ import annotations

import functools
import os
import threading
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from lerobot_mg.errors import ConfigError, config_error

# Encoders tried in order for each user-facing codec name. libx264 is the usual H.264 encoder in
# PyAV's bundled ffmpeg; "h264" names whatever H.264 encoder that build registers instead.
_ENCODER_CANDIDATES: dict[str, tuple[str, ...]] = {
    "h264": ("libx264", "h264"),
    "av1": ("libsvtav1", "libaom-av1"),
}
# Training reads frames in random order, so every read is a seek. H.264 is written all-intra (g=1: every frame a
# keyframe, hence no B-frames): a seek lands on the frame asked for and decodes it alone. Measured on 240x320
# frames (CPU time, one thread): a shuffled read decodes at ~0.9x a sequential decode of the same file with g=1,
# ~0.55x with g=2 and no B-frames, ~0.37x with g=2 and x264's default B-frames (their reorder delay makes every
# seek decode further), while the file grew ~4% over g=2 (scripts/bench_data.py; docs/data.md).
# AV1 keeps LeRobot's defaults (g=2, CRF 30), not measured here. CRF 20 keeps small smooth test images within a
# few levels.
_ENCODER_OPTIONS: dict[str, dict[str, str]] = {
    "h264": {"g": "1", "crf": "20"},
    "av1": {"g": "2", "crf": "30"},
}
PIX_FMT = "yuv420p"


@functools.cache
def single_thread_reformat() -> dict[str, int]:
    """The keywords of ``VideoReformatter.reformat`` that convert on the calling thread. PyAV 17 made reformatting
    multithreaded unless ``threads=1``; before it (av 15, which LeRobot 0.6.1 pins: ``av>=15,<16``) there is no
    ``threads`` argument and the conversion always runs on the calling thread. Asked of the installed PyAV once."""
    probe = av.VideoFrame(2, 2, PIX_FMT)
    try:
        VideoReformatter().reformat(probe, format="rgb24", threads=1)
    except TypeError:  # reformat() got an unexpected keyword argument 'threads'
        return {}
    return {"threads": 1}


def resolve_encoder(codec: str) -> str:
    """Returns the PyAV encoder name used for ``codec`` ("h264" or "av1") on this machine."""
    if codec not in _ENCODER_CANDIDATES:
        raise config_error("video_codec", codec, "is not supported",
                           f"video_codec=<one of {sorted(_ENCODER_CANDIDATES)}>")
    for name in _ENCODER_CANDIDATES[codec]:
        if name not in av.codecs_available:
            continue
        try:
            av.codec.Codec(name, "w")
        except (av.error.FFmpegError, ValueError):
            continue
        return name
    raise ConfigError(
        f"video_codec={codec!r}: none of the encoders {list(_ENCODER_CANDIDATES[codec])} is available in "
        f"this PyAV build (av {av.__version__}). Fix: video_codec=<another of {sorted(_ENCODER_CANDIDATES)}>, or "
        "install a PyAV build with one of those encoders"
    )


def check_encodable(key: str, codec: str, height: int, width: int) -> str:
    """Returns the encoder for ``codec``; raises if frames of ``height x width`` cannot be encoded."""
    # yuv420p subsamples chroma 2x2, which the encoders only accept for even sizes.
    if height % 2 or width % 2:
        raise config_error(
            f"features[{key!r}]['shape']", [height, width, 3],
            f"a video of {height}x{width} frames cannot be encoded as {PIX_FMT}: height and width must be even",
            f"resize the frames to even sizes, or store the feature with features[{key!r}]['dtype']='image'",
        )
    return resolve_encoder(codec)


class VideoEncoder:
    """Appends RGB frames to one MP4 file; successive episodes continue the same timeline."""

    def __init__(self, key: str, path: Path, fps: int, height: int, width: int, codec: str) -> None:
        self.encoder_name = check_encodable(key, codec, height, width)
        self.path = path
        self.fps = fps
        self.height = height
        self.width = width
        path.parent.mkdir(parents=True, exist_ok=True)
        self._container = av.open(str(path), mode="w")
        self._stream = self._container.add_stream(
            self.encoder_name, rate=fps, options=dict(_ENCODER_OPTIONS[codec])
        )
        self._stream.width = width
        self._stream.height = height
        self._stream.pix_fmt = PIX_FMT
        self._stream.time_base = Fraction(1, fps)
        self.num_frames = 0

    def add_frames(self, frames_THWC: np.ndarray) -> None:
        if frames_THWC.dtype != np.uint8 or frames_THWC.shape[1:] != (self.height, self.width, 3):
            raise ConfigError(
                f"{self.path}: the video frames are {frames_THWC.dtype} of shape {tuple(frames_THWC.shape)}, not "
                f"uint8 of shape (T, {self.height}, {self.width}, 3). Fix: pass uint8 frames of shape "
                f"(T, {self.height}, {self.width}, 3)"
            )
        for frame_HWC in frames_THWC:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame_HWC), format="rgb24")
            frame.pts = self.num_frames
            frame.time_base = Fraction(1, self.fps)
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
            self.num_frames += 1

    def close(self) -> None:
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()

    def info(self) -> dict[str, object]:
        """The ``info`` block LeRobot stores for a video feature in meta/info.json."""
        return {
            "video.height": self.height,
            "video.width": self.width,
            "video.codec": av.codec.Codec(self.encoder_name, "w").canonical_name,
            "video.pix_fmt": PIX_FMT,
            "video.is_depth_map": False,
            "video.fps": self.fps,
            "video.channels": 3,
            "has_audio": False,
        }


def video_frame_count(path: Path, fps: int) -> int:
    """Frames in ``path``'s first video stream, from its header (the mp4 sample table): nothing is decoded."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.frames:
            return int(stream.frames)
        # Containers without a frame count in the header: their duration at ``fps``.
        duration_s = float(stream.duration * stream.time_base) if stream.duration else container.duration / av.time_base
        return round(duration_s * fps)


class VideoFrameReader:
    """Decodes frames at given timestamps, keeping one open container per file and per process.

    DataLoader workers fork the dataset: a container opened in the parent must not be used in a
    child (its demuxer and decoder state are copies), so the cache belongs to the process that filled it.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._containers: dict[Path, av.container.InputContainer] = {}
        self._lock = threading.Lock()  # cameras decode in threads: one fills the cache while another reads it
        # One RGB converter per file keeps swscale's context from one frame to the next (``frame.to_ndarray``
        # builds a new one per frame, which cost more than the conversion itself: 0.3 against 0.05 ms at 240x320).
        # Per file, not per reader: cameras decode in parallel threads, and a context must not be shared by two.
        self._rgb: dict[Path, VideoReformatter] = {}

    def _container(self, path: Path) -> av.container.InputContainer:
        with self._lock:
            return self._open(path)

    def _open(self, path: Path) -> av.container.InputContainer:
        if self._pid != os.getpid():
            # Freeing the parent's copies here is safe only because they decode and convert without threads.
            self._containers, self._rgb = {}, {}
            self._pid = os.getpid()
        if path not in self._containers:
            container = av.open(str(path))
            # Single-threaded decoding: a forked DataLoader worker inherits (and may garbage-collect)
            # containers of its parent, and freeing a decoder whose threads live in another process
            # hangs or segfaults. Workers already decode in parallel with each other.
            container.streams.video[0].thread_type = "NONE"
            container.streams.video[0].codec_context.thread_count = 1
            self._containers[path] = container
            self._rgb[path] = VideoReformatter()
        return self._containers[path]

    def decode(self, path: Path, timestamps_s: list[float], tolerance_s: float) -> np.ndarray:
        """Returns uint8 frames ``(T, H, W, 3)``, the frame nearest each timestamp of ``path``.

        Seeks once to the keyframe at or before the earliest timestamp, then decodes packet by packet up to the
        latest one and no further; only the frames asked for are converted to RGB.
        """
        container = self._container(path)
        stream = container.streams.video[0]
        first_s, last_s = min(timestamps_s), max(timestamps_s)
        # Rounded, not floored: a float timestamp a hair below a frame's time must not seek to the keyframe before.
        container.seek(round(first_s / stream.time_base), stream=stream, backward=True, any_frame=False)
        decoded: list[tuple[float, av.VideoFrame]] = []
        for packet in container.demux(stream):
            for frame in stream.codec_context.decode(packet):
                frame_time_s = float(frame.pts * stream.time_base)
                if frame_time_s >= first_s - tolerance_s:
                    decoded.append((frame_time_s, frame))
            if decoded and decoded[-1][0] >= last_s - tolerance_s:
                break
        if not decoded:
            raise ConfigError(f"{path}: has no video frame at or after {first_s:.6f}s; the video is too short for "
                              "its episodes table. Fix: download or regenerate the dataset.")
        times_s = np.asarray([time_s for time_s, _ in decoded])
        rgb: dict[int, np.ndarray] = {}  # an episode edge repeats a frame: convert it once
        frames = []
        for query_s in timestamps_s:
            nearest = int(np.argmin(np.abs(times_s - query_s)))
            if abs(times_s[nearest] - query_s) > tolerance_s:
                raise ConfigError(
                    f"{path}: requested frame at {query_s:.6f}s but the nearest decoded frame is at "
                    f"{times_s[nearest]:.6f}s (more than tolerance_s={tolerance_s} away); the video and "
                    "the parquet timestamps disagree, or tolerance_s is too small for this file. Fix: download "
                    "or regenerate the dataset."
                )
            if nearest not in rgb:
                # One thread, as the decoder: a forked worker frees its parent's copy, which must own no threads.
                frame = self._rgb[path].reformat(decoded[nearest][1], format="rgb24", **single_thread_reformat())
                rgb[nearest] = frame.to_ndarray()
            frames.append(rgb[nearest])
        return frames[0][None] if len(frames) == 1 else np.stack(frames)  # one frame: a view, not a copy

    def __reduce__(self) -> tuple[type, tuple]:
        # What crosses a process boundary (spawned DataLoader workers) is an empty reader: containers and locks
        # belong to the process that made them.
        return VideoFrameReader, ()

    def close(self) -> None:
        if self._pid == os.getpid():
            for container in self._containers.values():
                container.close()
            self._containers = {}
