"""Upload: a dataset becomes shard objects and a manifest in a bucket."""

from remote_loader.upload.encode import EncodeOptions
from remote_loader.upload.sources import ImageFolder, VideoFolder, load_source
from remote_loader.upload.summary import UploadSummary
from remote_loader.upload.uploader import upload_cv_dataset

__all__ = ["EncodeOptions", "ImageFolder", "UploadSummary", "VideoFolder", "load_source", "upload_cv_dataset"]
