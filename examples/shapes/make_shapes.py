"""A generated detection data set in PASCAL VOC's layout (shapes on textured backgrounds, several
per image), for trying Caffe's detectors without downloading VOC or COCO.

    python examples/shapes/make_shapes.py [--root examples/shapes/data] [--trainval 48]
        [--test 16] [--size 96] [--seed 0] [--classes circle,square,triangle,cross]
        [--max-objects 4] [--lmdb]

writes under --root JPEGImages/, Annotations/ (VOC's xml), ImageSets/Main/{trainval,test}.txt,
the list files trainval.txt and test.txt (`JPEGImages/<id>.jpg Annotations/<id>.xml`, what
`caffepy convert_annoset` reads), test_name_size.txt and labelmap.prototxt (SSD's LabelMap:
background 0, then the classes); with --lmdb also trainval_lmdb and test_lmdb (convert_annoset,
encoded, as Intel Caffe's data/VOC0712/create_data.sh). The same seed gives the same files;
image i does not depend on how many were asked for. Use --size 300 for SSD300. The generator is
caffepy.data.shapes.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from caffepy.data.shapes import CLASSES, write_lmdbs, write_shapes  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=os.path.join("examples", "shapes", "data"))
    p.add_argument("--trainval", type=int, default=48)
    p.add_argument("--test", type=int, default=16)
    p.add_argument("--size", type=int, default=96, help="image side in pixels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--classes", default=",".join(CLASSES),
                   help=f"comma-separated, a subset of {','.join(CLASSES)}")
    p.add_argument("--max-objects", type=int, default=4)
    p.add_argument("--lmdb", action="store_true", help="also convert both splits to LMDBs of AnnotatedDatum")
    args = p.parse_args(argv)
    classes = tuple(c for c in args.classes.split(",") if c)
    unknown = [c for c in classes if c not in CLASSES]
    if unknown or not classes:
        p.error(f"--classes: unknown shape {unknown[0] if unknown else '(none)'}; "
                f"known: {','.join(CLASSES)}")
    if args.size < 16 or args.trainval < 0 or args.test < 0 or args.max_objects < 1:
        p.error("--size must be at least 16, --trainval and --test at least 0, "
                "--max-objects at least 1")
    start = time.time()
    splits = write_shapes(args.root, args.trainval, args.test, args.size, args.seed, classes,
                          args.max_objects)
    print(f"{args.root}: {len(splits['trainval'])} trainval + {len(splits['test'])} test images "
          f"of {args.size}x{args.size}, {len(classes)} classes, in {time.time() - start:.1f} s")
    if args.lmdb:
        for split, path in write_lmdbs(args.root).items():
            print(f"{path}: {len(splits[split])} AnnotatedDatum records")


if __name__ == "__main__":
    main()
