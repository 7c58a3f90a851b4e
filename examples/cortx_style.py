"""The cortx_pytorch flow, end to end: make_client, upload_cv_dataset, then a RemoteDataset chain.

    python examples/cortx_style.py --url s3://testbucket/imagenet-val --source /data/imagenet/val
    python examples/cortx_style.py --local-server     # a generated dataset on an embedded server

Code written for cortx_pytorch runs with only its import changed. Any torchvision-style
dataset (``len(ds)``, ``ds[i] -> (image, label)``) can be uploaded: here an image folder
with ``--source``, or generated in-memory PIL images. The augmentation is torchvision's
when it is installed, an equivalent few lines of PIL otherwise.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch as ch
from common import add_location_args, maybe_local_server
from PIL import Image
from tqdm import tqdm

from remote_loader import ImageFolder, RemoteDataset, make_client, upload_cv_dataset
from remote_loader.storage import parse_location
from remote_loader.testing.synthetic import SyntheticImages

SIZE = 224


def plain_preproc(image: Image.Image) -> ch.Tensor:
    """Random-resized crop, horizontal flip, to a float CxHxW tensor in [0, 1] (no torchvision)."""
    width, height = image.size
    scale, aspect = random.uniform(0.08, 1.0), np.exp(random.uniform(np.log(3 / 4), np.log(4 / 3)))
    w = min(width, int(round((width * height * scale * aspect) ** 0.5)))
    h = min(height, int(round((width * height * scale / aspect) ** 0.5)))
    left, top = random.randint(0, width - w), random.randint(0, height - h)
    crop = image.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if random.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return ch.from_numpy(np.asarray(crop, dtype=np.float32) / 255).permute(2, 0, 1)


try:
    from torchvision import transforms
except Exception:  # not installed, or a build that does not import beside this torch
    preproc = plain_preproc
else:
    preproc = transforms.Compose([
        transforms.RandomResizedCrop(SIZE),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_location_args(parser, "cortx")
    parser.add_argument("--source", help="an image folder to upload (default: generated images)")
    parser.add_argument("--images", type=int, default=200, help="images to generate without --source")
    parser.add_argument("--workers", type=int, default=2, help="encoding processes and DataLoader workers")
    args = parser.parse_args()

    with maybe_local_server(args):
        # Define the connection settings for our client: make_client(URL, ACCESS_KEY, SECRET_KEY),
        # or, as here, from the AWS_* / MINIO_* environment variables.
        client = make_client()
        location = parse_location(args.url)
        bucket, folder = location.bucket, location.base_folder

        # Pack and upload any computer vision dataset; it only needs to be done once.
        ds = ImageFolder(args.source) if args.source else SyntheticImages(args.images, output="pil")
        upload_cv_dataset(ds, client=client, bucket=bucket, base_folder=folder, maxsize=1e8 if args.source else 2e6,
                          maxcount=100000, workers=args.workers)

        # Now that the dataset is in the bucket, use it in PyTorch.
        samples = RemoteDataset(client, bucket, folder)
        dataset = (samples
                   .decode("pil")  # Decode the data as PIL images
                   .to_tuple("jpg;png", "cls")  # Extract images and labels from the dataset
                   .map_tuple(preproc, lambda x: x)  # Apply data augmentations
                   .batched(64)  # Make batches of 64 images
                   )
        # A regular PyTorch data loader, as for any other dataset.
        dataloader = ch.utils.data.DataLoader(dataset, num_workers=args.workers, batch_size=None)
        seen, batches, shapes = 0, 0, set()
        for image, label in tqdm(dataloader):  # len(dataloader): the batches of one epoch
            batches += 1
            # Train / evaluate ML models on this batch of data
            seen += len(label)
            shapes.add(tuple(image.shape[1:]))
        client.close()
    print(f"{seen} images in {batches} batches of up to 64, each {sorted(shapes)} float tensors;"
          f" dataset has {len(samples)}")
    if seen != len(samples) or batches != len(dataset) or shapes != {(3, SIZE, SIZE)}:
        raise SystemExit("the loader did not deliver one epoch of 224x224 crops")


if __name__ == "__main__":
    main()
