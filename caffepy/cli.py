"""The `caffepy` command: Caffe's subcommands and flags, argument handling and exit codes only.

Caffe's gflags spellings work too: `-solver x` and `-solver=x` are read as
`--solver x`, and boolean flags accept `-gray=true` / `-gray=false` / `-nogray`;
`-help`, `help` and a bare `caffepy` print the usage. Caffe's gflags are global:
each of its actions (train, test, time, collect, compare, device_query) takes
every flag of Caffe's and Intel Caffe's tools/caffe.cpp, checks its type, and
ignores with a warning those that mean nothing for it (hidden from --help).
Known errors (CaffepyError) print one line and exit 1 (usage errors, click's
too, 2); an exception from a Python layer's own code prints the layer's name and
that code's traceback and exits 1;
Ctrl-C (SIGINT; `train` handles it itself once training runs, see
--sigint_effect) prints one line and exits 130, as the shell reports a
process SIGINT ended, once the command has removed what it was writing;
anything else is a bug and keeps its traceback.
"""
import functools
import re
import sys

import click
from click.core import ParameterSource

from . import engine, log
from .errors import CaffepyError, one_line, python_layer_report

_GPU_HELP = ("Caffe's GPU ids ('0', '0,1' or 'all'): accepted so Caffe's scripts run, and ignored "
             "with a warning; caffepy runs on the CPU.")
SIGNAL_EFFECTS = click.Choice(["stop", "snapshot", "none"])
_FLAG = re.compile(r"^-{1,2}([A-Za-z][A-Za-z0-9_]*)(=(.*))?$")


def gflags_to_click(args, bool_flags, short_flags=()):
    """Rewrite gflags spellings to click's: -name -> --name, -flag=false -> --no-flag. A
    command's own one-letter options (`short_flags`, e.g. summarize's -w) stay as they are."""
    out = []
    for arg in args:
        m = _FLAG.match(arg)
        if not m or arg in ("-h",) or arg in short_flags:
            out.append(arg)
            continue
        name, value = m.group(1), m.group(3)
        if value is None and name.startswith("no") and name[2:] in bool_flags:
            out.append(f"--no-{name[2:]}")      # gflags' -noflag
        elif name in bool_flags and value is not None:
            truth = value.lower()
            if truth in ("true", "1", "yes", "t", "y"):
                out.append(f"--{name}")
            elif truth in ("false", "0", "no", "f", "n"):
                out.append(f"--no-{name}")
            else:
                raise click.UsageError(f"--{name}: expected true or false, got '{value}'")
        elif value is not None:
            out.append(f"--{name}={value}")
        else:
            out.append(f"--{name}")
    return out


_HELP = {"-help", "--help", "help", "-h", "-helpfull", "--helpfull"}


class CaffeGroup(click.Group):
    def parse_args(self, ctx, args):
        # gflags' -help, and `help [command]`; bare `caffepy` prints the usage and exits 0,
        # as Caffe's main() returns 0 after ShowUsageWithFlags
        if not args or args[0] in _HELP:
            name = args[1] if args[:1] == ["help"] and len(args) > 1 else None
            command = self.get_command(ctx, name) if name else None
            if command is not None:
                ctx = click.Context(command, info_name=name, parent=ctx)
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args):
        cmd_name, cmd, rest = super().resolve_command(ctx, args)
        bool_flags = {o.name for o in cmd.params if isinstance(o, click.Option) and o.is_flag}
        short_flags = {f for o in cmd.params if isinstance(o, click.Option) for f in o.opts
                       if len(f) == 2 and f[0] == "-"}
        args = gflags_to_click(rest, bool_flags, short_flags)
        ctx.meta["caffepy.args"] = list(args)      # train --restart runs the command again with them
        return cmd_name, cmd, args

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CaffepyError as e:
            click.echo(f"caffepy: error: {log.rank_prefix()}{one_line(e)}", err=True)
            ctx.exit(e.exit_code)
        except click.UsageError as e:       # click's own (a bad choice, a missing flag): one line too
            where = e.ctx.command_path if e.ctx is not None else "caffepy"
            problem = e.format_message()
            problem += " " if problem.endswith((".", "?")) else ". "
            click.echo(f"caffepy: error: {log.rank_prefix()}{where}: {problem}'{where} -help' shows the usage",
                       err=True)
            ctx.exit(e.exit_code)
        except Exception as e:
            report = python_layer_report(e)     # the user's layer code: its own traceback
            if report is None:
                raise
            click.echo(f"caffepy: error: {log.rank_prefix()}{report}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            db = sys.modules.get("caffepy.data.db")     # loaded only by commands that write one
            if db is not None:
                db.abort_unfinished()
            name = ctx.invoked_subcommand or "caffepy"
            click.echo(f"caffepy: error: {log.rank_prefix()}{name}: interrupted (SIGINT); "
                       f"nothing half-written was left", err=True)
            ctx.exit(130)


@click.group(cls=CaffeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="caffepy")
def main():
    """caffepy: the Caffe command line, on CPUs, with MPI.

    \b
    usage: caffepy <command> <args>   (caffepy <command> -help for its flags)
    commands like caffe's:
      train           train or fine-tune a model
      test            score a model
      time            benchmark model execution time
      collect         write every layer's blobs of one iteration, one file each
      compare         run that iteration again and find the first layer that differs
      device_query    show CPU and MPI details
    Caffe's flags are global: each of these takes them all and ignores, with a
    warning, those that mean nothing for it.
    """
    log.configure(program="caffepy", also_to_stderr=True)


def _stages(values):
    return [s for v in values for s in v.split(",") if s]


def _engine_flag(ctx, param, value):
    if value is None:
        return ""
    wrong = engine.problem(value)
    if wrong:
        raise click.BadParameter(f"{wrong}, got '{value}'. Accepted: {engine.ACCEPTED}", ctx=ctx,
                                 param=param)
    return value.strip()


_ENGINE_HELP = ("Intel Caffe's engine for the net's layers that name none: CAFFE (Caffe's algorithms), "
                "MKLDNN[:CPU] or MKL2017 (caffepy's fast path), DEFAULT. It overrides the net's and the "
                "solver's engine; a layer's own engine still wins (see the README).")
engine_option = click.option("--engine", metavar="ENGINE", callback=_engine_flag, help=_ENGINE_HELP)


# -- the -precision flag of train, test and time (caffepy/precision.py) ---------------------------
def _precision_flag(ctx, param, value):
    from . import precision
    if value.strip().lower() == "all" and ctx.command.name == "time":
        return "all"
    wrong = precision.problem(value)
    if wrong:
        raise click.BadParameter(f"{wrong} '{value}'; accepted: {precision.ACCEPTED}", ctx=ctx,
                                 param=param)
    return value.strip().lower()


precision_option = click.option(
    "--precision", default="f32", show_default=True, metavar="PRECISION", callback=_precision_flag,
    help="f32, or bf16: Convolution and InnerProduct in bfloat16 (bf16-rounded inputs and weights, "
         "float32 sums; training keeps float32 master weights), on AMX-BF16 or AVX512_BF16 kernels where "
         "the CPU has them; elsewhere only emulated, with CAFFEPY_BF16=emulate set, slower than f32, to "
         "measure its accuracy (device_query says which). time takes all too: the TEST forward in f32, "
         "int8 (the net's quantization_param) and bf16 side by side.")


def _use_precision(value):
    from . import precision
    precision.set_precision(value)


# -- caffe's four commands -----------------------------------------------------
@main.command()
@click.option("--solver", required=True, metavar="FILE", help="The solver definition protocol buffer text file.")
@click.option("--weights", metavar="FILES", help="Comma-separated .caffemodel files to initialize from (fine-tune).")
@click.option("--snapshot", metavar="FILE", help="A .solverstate to resume training from.")
@click.option("--level", default=0, type=int, help="Net level, for include/exclude rules.")
@click.option("--stage", multiple=True, help="Net stage(s), comma-separated, for include/exclude rules.")
@click.option("--sigint_effect", type=SIGNAL_EFFECTS, default="stop", show_default=True,
              help="What to do on SIGINT (Ctrl-C).")
@click.option("--sighup_effect", type=SIGNAL_EFFECTS, default="snapshot", show_default=True,
              help="What to do on SIGHUP (under MPI also on SIGUSR1, which mpiexec passes on to the "
                   "ranks; MPICH's mpiexec dies of SIGHUP itself).")
@click.option("--stall_timeout", type=click.FloatRange(min=0), default=300, show_default=True,
              metavar="SECONDS",
              help="Under MPI: when a rank makes no progress for this long (stopped, hung, its host "
                   "lost), end the job with a line naming it and where the others waited; 0: never.")
@engine_option
@precision_option
@click.option("--tensorboard", metavar="DIR",
              help="Write TensorBoard event files here: losses, outputs, learning rate, speed, test "
                   "scores (needs the tensorboard extra; `tensorboard --logdir DIR` shows them).")
@click.option("--tensorboard_histograms", type=click.IntRange(min=0), default=0, metavar="K",
              help="With --tensorboard: histograms of every weight and gradient every K iterations "
                   "(0: none).")
@click.option("--restart", type=click.IntRange(min=0), metavar="N",
              help="Supervise the job (run outside of mpiexec, with --launcher): when it fails, run it "
                   "again from the newest snapshot (a lost rank's emergency snapshot), up to N times.")
@click.option("--launcher", metavar="COMMAND",
              help="With --restart: the command that starts the ranks, e.g. 'mpiexec -n 4 -f hosts' "
                   "(default: one process).")
@click.option("--gpu", metavar="IDS", help=_GPU_HELP)
def train(solver, weights, snapshot, level, stage, sigint_effect, sighup_effect, stall_timeout, engine,
          precision, tensorboard, tensorboard_histograms, restart, launcher, gpu):
    """Train or fine-tune a model (mpirun -n N for several ranks). SOLVER may be an Intel Caffe
    multi-phase file (params_pair { solver_params { ... } batch_size: N } ...)."""
    if weights and snapshot:
        raise click.UsageError("give --snapshot or --weights, not both: --snapshot resumes a run, "
                               "--weights starts a new one from trained weights")
    if launcher is not None and restart is None:
        raise click.UsageError("--launcher goes with --restart N (the supervisor runs it); without it "
                               "run the launcher yourself: mpiexec -n 4 caffepy train ...")
    if restart is not None:
        from .parallel import failsafe
        code = failsafe.supervise_restarts(restart, launcher, solver,
                                           click.get_current_context().meta.get("caffepy.args", []))
        click.get_current_context().exit(code)
    _gpu_notice(gpu)
    from . import actions
    if tensorboard_histograms and not tensorboard:
        raise click.UsageError("--tensorboard_histograms needs --tensorboard DIR")
    _use_precision(precision)
    actions.train(solver=solver, weights=weights, snapshot=snapshot, level=level, stages=_stages(stage),
                  sigint_effect=sigint_effect, sighup_effect=sighup_effect, stall_timeout=stall_timeout,
                  engine=engine, tensorboard=tensorboard, histogram_interval=tensorboard_histograms)


@main.command()
@click.option("--model", required=True, metavar="FILE", help="The model definition protocol buffer text file.")
@click.option("--weights", metavar="FILES", help="Trained .caffemodel file(s), comma-separated.")
@click.option("--iterations", default=50, show_default=True, type=click.IntRange(min=1),
              help="The number of iterations to run.")
@click.option("--level", default=0, type=int, help="Net level, for include/exclude rules.")
@click.option("--stage", multiple=True, help="Net stage(s), comma-separated.")
@engine_option
@precision_option
@click.option("--sampling/--no-sampling", default=False,
              help="Intel Caffe's sampling mode: build the net, load the weights, and stop.")
@click.option("--detection/--no-detection", default=False,
              help="Score a detection net: its outputs are DetectionEvaluate's rows, turned into mAP "
                   "(SSD's flag).")
@click.option("--ap_version", type=click.Choice(["11point", "MaxIntegral", "Integral"]), default="11point",
              show_default=True, help="With --detection: VOC2007's 11-point AP (what Intel Caffe's tool "
                                      "prints), VOC2010's MaxIntegral, or the natural Integral.")
@click.option("--gpu", metavar="IDS", help=_GPU_HELP)
def test(model, weights, iterations, level, stage, engine, precision, sampling, detection, ap_version, gpu):
    """Score a model: run the TEST phase and average its outputs (with -detection: their mAP)."""
    _gpu_notice(gpu)
    _use_precision(precision)
    from . import actions
    actions.test(model=model, weights=weights, iterations=iterations, level=level, stages=_stages(stage),
                 engine=engine, sampling=sampling, detection=detection, ap_version=ap_version)


@main.command()
@click.option("--model", required=True, metavar="FILE", help="The model definition protocol buffer text file.")
@click.option("--weights", metavar="FILES", help="Optional .caffemodel file(s) to load first.")
@click.option("--iterations", default=50, show_default=True, type=click.IntRange(min=1),
              help="The number of timed iterations.")
@click.option("--phase", type=click.Choice(["TRAIN", "TEST"], case_sensitive=False), default="TRAIN",
              show_default=True, help="Network phase.")
@click.option("--level", default=0, type=int, help="Net level, for include/exclude rules.")
@click.option("--stage", multiple=True, help="Net stage(s), comma-separated.")
@click.option("--forward_only/--no-forward_only", default=False,
              help="Time the forward pass only (Intel Caffe's flag).")
@engine_option
@precision_option
@click.option("--gpu", metavar="IDS", help=_GPU_HELP)
def time(model, weights, iterations, phase, level, stage, forward_only, engine, precision, gpu):
    """Benchmark model execution time, layer by layer."""
    _gpu_notice(gpu)
    from . import actions
    if precision == "all":
        actions.time_precisions(model=model, weights=weights, iterations=min(iterations, 10),
                                level=level, stages=_stages(stage), engine=engine)
        return
    _use_precision(precision)
    actions.time(model=model, weights=weights, iterations=iterations, phase=phase.upper(), level=level,
                 stages=_stages(stage), forward_only=forward_only, engine=engine)


def _collect_options(f):
    for option in reversed([
            click.option("--model", required=True, metavar="FILE",
                         help="The model definition protocol buffer text file (run in the TRAIN phase)."),
            click.option("--weights", metavar="FILES",
                         help="Optional .caffemodel file(s) to load (else the fillers, seeded alike in "
                              "every run)."),
            click.option("--level", default=0, type=int, help="Net level, for include/exclude rules."),
            click.option("--stage", multiple=True, help="Net stage(s), comma-separated."),
            click.option("--collect_dir", default="collect_out", show_default=True, metavar="DIR",
                         help="Where collect writes the blobs, and compare reads them."),
            click.option("--buffer_filler", type=float, default=float("nan"), show_default="nan",
                         help="The value every diff holds before the forward pass."),
            engine_option,
            click.option("--gpu", metavar="IDS", help=_GPU_HELP)]):
        f = option(f)
    return f


@main.command()
@_collect_options
def collect(model, weights, level, stage, collect_dir, buffer_filler, engine, gpu):
    """Run one forward and backward pass and write every layer's blobs (bottoms and tops,
    their diffs, parameters and their gradients) into --collect_dir, one .npy file each,
    listed in index.txt (Intel Caffe's collect)."""
    _gpu_notice(gpu)
    from . import compare as tool
    tool.collect(model, collect_dir, weights=weights, level=level, stages=_stages(stage), engine=engine,
                 buffer_filler=buffer_filler)


@main.command()
@_collect_options
@click.option("--compare_output_dir", default="compare_out", show_default=True, metavar="DIR",
              help="Where the report and the differing values of each blob go.")
@click.option("--epsilon", type=click.FloatRange(min=0), default=1e-3, show_default=True,
              help="Values further apart than this (and than one float step) differ.")
@click.option("--fast_compare/--no-fast_compare", default=False,
              help="List at most --fast_compare_max differing values of a blob in its file.")
@click.option("--fast_compare_max", type=click.IntRange(min=1), default=50, show_default=True,
              help="How many values --fast_compare lists.")
def compare(model, weights, level, stage, collect_dir, buffer_filler, engine, gpu, compare_output_dir,
            epsilon, fast_compare, fast_compare_max):
    """Run what collect ran again, each layer on the inputs collect recorded, and compare every
    blob with --collect_dir's: prints each layer's largest difference and the first layer that
    differs beyond --epsilon; exits 1 if one does (Intel Caffe's compare)."""
    _gpu_notice(gpu)
    from . import compare as tool
    tool.compare(model, collect_dir, compare_output_dir, weights=weights, level=level,
                 stages=_stages(stage), engine=engine, buffer_filler=buffer_filler, epsilon=epsilon,
                 fast_compare_max=fast_compare_max if fast_compare else None)


@main.command("device_query")
@click.option("--gpu", hidden=True)
def device_query(gpu):
    """Describe this CPU (cores, vector ISA, threads) and the MPI library."""
    from . import device
    device.query()


# -- tools around it ------------------------------------------------------------
@main.command("convert_imageset")
@click.argument("root_folder", metavar="ROOTFOLDER/")
@click.argument("list_file", metavar="LISTFILE")
@click.argument("db_name", metavar="DB_NAME")
@click.option("--gray/--no-gray", default=False, help="Load images in grayscale.")
@click.option("--shuffle/--no-shuffle", default=False, help="Randomly shuffle the order of images.")
@click.option("--backend", type=click.Choice(["lmdb", "leveldb"]), default="lmdb", show_default=True,
              help="The backend for storing the result.")
@click.option("--resize_width", default=0, type=click.IntRange(min=0), help="Width images are resized to.")
@click.option("--resize_height", default=0, type=click.IntRange(min=0), help="Height images are resized to.")
@click.option("--check_size/--no-check_size", default=False, help="Check that all the datum have the same size.")
@click.option("--encoded/--no-encoded", default=False, help="Store the encoded image in the datum.")
@click.option("--encode_type", default="", help="Image format to encode to (png, jpg); default: the file's own.")
def convert_imageset(root_folder, list_file, db_name, gray, shuffle, backend, resize_width,
                     resize_height, check_size, encoded, encode_type):
    """Convert a set of images (LISTFILE lines: `path label`) to an LMDB or LevelDB of Datum."""
    from .data import tools
    tools.convert_imageset(root_folder, list_file, db_name, gray=gray, shuffle=shuffle, backend=backend,
                           resize_width=resize_width, resize_height=resize_height,
                           check_size=check_size, encoded=encoded, encode_type=encode_type)


@main.command("convert_annoset")
@click.argument("root_folder", metavar="ROOTFOLDER/")
@click.argument("list_file", metavar="LISTFILE")
@click.argument("db_name", metavar="DB_NAME")
@click.option("--anno_type", type=click.Choice(["classification", "detection"]), default="classification",
              show_default=True, help="classification: LISTFILE lines `image label`; detection: `image "
                                      "annotation_file` (boxes).")
@click.option("--label_type", type=click.Choice(["xml", "json", "txt"]), default="xml", show_default=True,
              help="The annotation files' format: VOC xml, the fork's COCO json, or `label xmin ymin xmax "
                   "ymax` lines.")
@click.option("--label_map_file", default="", metavar="FILE",
              help="The LabelMap prototxt that turns annotation names into labels (detection).")
@click.option("--check_label/--no-check_label", default=False, help="Refuse a label map that gives a name twice.")
@click.option("--min_dim", default=0, type=click.IntRange(min=0),
              help="Resize (keeping the aspect ratio) so the shorter side is at least this.")
@click.option("--max_dim", default=0, type=click.IntRange(min=0),
              help="Resize (keeping the aspect ratio) so the longer side is at most this.")
@click.option("--resize_width", default=0, type=click.IntRange(min=0), help="Width images are resized to.")
@click.option("--resize_height", default=0, type=click.IntRange(min=0), help="Height images are resized to.")
@click.option("--backend", type=click.Choice(["lmdb", "leveldb"]), default="lmdb", show_default=True,
              help="The backend for storing the result.")
@click.option("--shuffle/--no-shuffle", default=False, help="Randomly shuffle the order of images.")
@click.option("--check_size/--no-check_size", default=False, help="Check that all the images have the same size.")
@click.option("--encoded/--no-encoded", default=False, help="Store the encoded image in the datum.")
@click.option("--encode_type", default="", help="Image format to encode to (png, jpg); default: the file's own.")
@click.option("--gray/--no-gray", default=False, help="Load images in grayscale.")
def convert_annoset(root_folder, list_file, db_name, anno_type, label_type, label_map_file, check_label,
                    min_dim, max_dim, resize_width, resize_height, backend, shuffle, check_size, encoded,
                    encode_type, gray):
    """Convert images and their annotations to an LMDB or LevelDB of AnnotatedDatum (SSD's
    convert_annoset)."""
    from .data import annoset
    annoset.convert_annoset(root_folder, list_file, db_name, anno_type=anno_type, label_type=label_type,
                            label_map_file=label_map_file, check_label=check_label, min_dim=min_dim,
                            max_dim=max_dim, resize_height=resize_height, resize_width=resize_width,
                            backend=backend, shuffle=shuffle, check_size=check_size, encode_type=encode_type,
                            encoded=encoded, gray=gray)


@main.command("create_label_map")
@click.argument("map_file", metavar="MAPFILE")
@click.argument("out_file", metavar="OUTFILE")
@click.option("--include_background/--no-include_background", default=False,
              help="Make none_of_the_above (display name background) label 0.")
@click.option("--delimiter", default=" ", show_default=True,
              help="The characters that separate a line's fields (name [label [display_name]]).")
def create_label_map(map_file, out_file, include_background, delimiter):
    """Write a LabelMap prototxt from a file of label names (SSD's create_label_map)."""
    from .data import annoset
    annoset.create_label_map(map_file, out_file, include_background, delimiter)


@main.command("get_image_size")
@click.argument("root_folder", metavar="ROOTFOLDER/")
@click.argument("list_file", metavar="LISTFILE")
@click.argument("out_file", metavar="OUTFILE")
@click.option("--name_id_file", default="", metavar="FILE",
              help="`name id` lines: write each image's id instead of its name.")
def get_image_size(root_folder, list_file, out_file, name_id_file):
    """Write `name height width` for each image of LISTFILE (SSD's get_image_size; what
    DetectionEvaluate's name_size_file reads)."""
    from .data import annoset
    annoset.get_image_size(root_folder, list_file, out_file, name_id_file)


@main.command("extract_features")
@click.argument("pretrained_net_param")
@click.argument("feature_extraction_proto_file")
@click.argument("blob_names", metavar="EXTRACT_FEATURE_BLOB_NAME1[,NAME2,...]")
@click.argument("dataset_names", metavar="SAVE_FEATURE_DATASET_NAME1[,NAME2,...]")
@click.argument("num_mini_batches", type=int)
@click.argument("db_type")
@click.argument("device", metavar="[CPU|GPU]", required=False, type=click.Choice(["CPU", "GPU"]))
@click.argument("device_id", metavar="[DEVICE_ID]", required=False, type=click.IntRange(min=0))
def extract_features(pretrained_net_param, feature_extraction_proto_file, blob_names, dataset_names,
                     num_mini_batches, db_type, device, device_id):
    """Write the values of blobs of a TEST net (weights from PRETRAINED_NET_PARAM), item by
    item, into new databases of Datum (Caffe's extract_features; DB_TYPE lmdb or leveldb)."""
    from . import actions
    if device == "GPU":
        _gpu_notice(str(device_id or 0))
    actions.extract_features(pretrained_net_param, feature_extraction_proto_file, blob_names,
                             dataset_names, num_mini_batches, db_type)


@main.command("convert_mnist_data")
@click.argument("image_file", metavar="INPUT_IMAGE_FILE")
@click.argument("label_file", metavar="INPUT_LABEL_FILE")
@click.argument("db_path", metavar="OUTPUT_DB_FILE")
@click.option("--backend", type=click.Choice(["lmdb", "leveldb"]), default="lmdb", show_default=True,
              help="The backend for storing the result.")
def convert_mnist_data(image_file, label_file, db_path, backend):
    """Convert MNIST's idx image and label files (gunzipped or not) to an LMDB or LevelDB of Datum."""
    from .data import tools
    tools.convert_mnist_data(image_file, label_file, db_path, backend)


@main.command("convert_mnist_siamese_data")
@click.argument("image_file", metavar="INPUT_IMAGE_FILE")
@click.argument("label_file", metavar="INPUT_LABEL_FILE")
@click.argument("db_path", metavar="OUTPUT_DB_FILE")
@click.option("--backend", type=click.Choice(["lmdb", "leveldb"]), default="leveldb", show_default=True,
              help="The backend for storing the result.")
def convert_mnist_siamese_data(image_file, label_file, db_path, backend):
    """Pair MNIST's items at random into 2-channel Datum (label 1: the same digit) for Caffe's
    siamese example."""
    from .data import tools
    tools.convert_mnist_siamese_data(image_file, label_file, db_path, backend)


@main.command("convert_cifar_data")
@click.argument("input_folder")
@click.argument("output_folder")
@click.argument("db_type", type=click.Choice(["lmdb", "leveldb"]))
def convert_cifar_data(input_folder, output_folder, db_type):
    """Convert CIFAR-10's binary batches (data_batch_1..5.bin, test_batch.bin in INPUT_FOLDER)
    to OUTPUT_FOLDER/cifar10_train_DB_TYPE and cifar10_test_DB_TYPE."""
    from .data import tools
    tools.convert_cifar_data(input_folder, output_folder, db_type)


@main.command("compute_image_mean")
@click.argument("input_db")
@click.argument("output_file", required=False)
@click.option("--backend", type=click.Choice(["lmdb", "leveldb"]),
              help="The kind of INPUT_DB (by default, the kind it is found to be).")
def compute_image_mean(input_db, output_file, backend):
    """Compute the mean image of an LMDB or LevelDB of Datum (written as .binaryproto)."""
    from .data import tools
    tools.compute_image_mean(input_db, output_file, backend)


@main.command("upgrade_net_proto_text")
@click.argument("input_file")
@click.argument("output_file")
def upgrade_net_proto_text(input_file, output_file):
    """Upgrade a V0/V1 net prototxt to the current format."""
    _upgrade_net(input_file, output_file, binary=False)


@main.command("upgrade_net_proto_binary")
@click.argument("input_file")
@click.argument("output_file")
def upgrade_net_proto_binary(input_file, output_file):
    """Upgrade a V0/V1 binary .caffemodel to the current format."""
    _upgrade_net(input_file, output_file, binary=True)


def _upgrade_net(input_file, output_file, binary):
    from . import upgrade
    if not upgrade.upgrade_net_file(input_file, output_file, binary=binary):
        raise click.exceptions.Exit(1)   # partially upgraded, as Caffe's tool reports


@main.command("upgrade_solver_proto_text")
@click.argument("input_file")
@click.argument("output_file")
def upgrade_solver_proto_text(input_file, output_file):
    """Upgrade a solver prototxt (solver_type enum to type string)."""
    from . import upgrade
    upgrade.upgrade_solver_file(input_file, output_file)


@main.command("parse_log")
@click.argument("logfile")
@click.argument("output_dir")
@click.option("--delimiter", default=",", show_default=True, help="Column delimiter in the output tables.")
def parse_log(logfile, output_dir, delimiter):
    """Parse a training log into LOGFILE.train and LOGFILE.test tables (as Caffe's parse_log.py)."""
    from . import logtools
    logtools.parse_log_command(logfile, output_dir, delimiter)


@main.command("plot_log")
@click.argument("args", nargs=-1, metavar="CHART_TYPE OUT.png LOG [LOG...] | LOG OUT.png")
def plot_log(args):
    """Plot training logs (needs matplotlib). With a chart type, as Caffe's
    tools/extra/plot_training_log.py: that chart of every LOG on one figure, each labelled with
    its file name. Without one, caffepy's overview of one LOG: train outputs, test outputs and
    the learning rate against iterations.

    \b
    Chart types (Caffe's numbers, logtools.CHART_TYPES):
        0: Test accuracy  vs. Iters
        1: Test accuracy  vs. Seconds
        2: Test loss  vs. Iters
        3: Test loss  vs. Seconds
        4: Train learning rate  vs. Iters
        5: Train learning rate  vs. Seconds
        6: Train loss  vs. Iters
        7: Train loss  vs. Seconds
    """
    from . import logtools
    if len(args) >= 3 and re.fullmatch(r"-?\d+", args[0]):
        logtools.plot_chart(int(args[0]), args[1], list(args[2:]))
    elif len(args) == 2:
        logtools.plot_log(args[0], args[1])
    else:
        raise click.UsageError("give CHART_TYPE OUT.png LOG [LOG...] (Caffe's plot_training_log.py) or "
                               "LOG OUT.png (the overview)")


@main.command()
@click.option("--model", required=True, metavar="FILE",
              help="The float32 net (its TEST phase and data layer give the batches).")
@click.option("--weights", required=True, metavar="FILES", help="Its .caffemodel file(s).")
@click.option("--output", required=True, metavar="FILE", help="Where to write the int8 net.")
@click.option("--sampling_iterations", default=10, show_default=True, type=click.IntRange(min=1),
              help="Batches measured for the scales (Intel's -s).")
@click.option("--iterations", default=10, show_default=True, type=click.IntRange(min=1),
              help="Held-out batches that score the int8 net (Intel's -i).")
@click.option("--accuracy_loss", default=0.01, show_default=True, type=click.FloatRange(min=0),
              help="How far the int8 net's accuracy may differ from float32's, either way; beyond it, "
                   "layers stay float32 (Intel's -l).")
@click.option("--weights_channel", type=click.Choice(["single", "multiple"]), default="single",
              show_default=True, help="One weight scale per layer or per output channel (Intel's -c).")
@click.option("--first_conv/--no-first_conv", default=False,
              help="Quantize the first convolution too (Intel's -1st).")
@click.option("--fc_int8/--no-fc_int8", default=False, help="Quantize InnerProduct layers too (Intel's -fc).")
@click.option("--unify_concat_scales/--no-unify_concat_scales", default=False,
              help="Give the convolutions feeding a concat their smallest scale_out, so the concat "
                   "passes their 8-bit values on as they are (Intel's -f).")
def calibrate(model, weights, output, sampling_iterations, iterations, accuracy_loss,
              weights_channel, first_conv, fc_int8, unify_concat_scales):
    """Write the net with quantization_param, as Intel Caffe's calibrator does."""
    from . import calibrate as cal
    cal.calibrate(model, weights, output, sampling_iterations, iterations, accuracy_loss,
                  weights_channel, first_conv, fc_int8, unify_concat_scales)


@main.command("export_onnx")
@click.argument("net", metavar="NET.prototxt")
@click.argument("weights", metavar="WEIGHTS.caffemodel")
@click.argument("output", metavar="OUT.onnx")
def export_onnx(net, weights, output):
    """Export a TEST net and its weights to ONNX (needs the onnx extra; see the README for the
    layer types mapped)."""
    from . import onnx_export
    onnx_export.export_files(net, weights, output)


@main.command("draw_net")
@click.argument("input_net_proto_file", metavar="NET_PROTOTXT")
@click.argument("output_image_file", metavar="OUTPUT_FILE")
@click.option("--rankdir", type=click.Choice(["LR", "TB", "BT", "RL"]), default="LR", show_default=True,
              help="Layout direction: LR (left to right), TB (top to bottom), BT, RL.")
@click.option("--phase", type=click.Choice(["TRAIN", "TEST", "ALL"], case_sensitive=False), default="ALL",
              show_default=True, help="Draw the layers of this phase only; ALL draws every layer.")
@click.option("--display_lrm/--no-display_lrm", default=False,
              help="Show the learning rate multipliers of Convolution, Deconvolution and InnerProduct.")
def draw_net(input_net_proto_file, output_image_file, rankdir, phase, display_lrm):
    """Draw a net as a graph; the format comes from OUTPUT_FILE's extension (.png, .svg, .pdf
    through Graphviz's dot; .raw for the DOT text)."""
    from . import draw, upgrade
    from .proto import caffe_pb2
    net = upgrade.read_net(input_net_proto_file)
    phases = {"TRAIN": caffe_pb2.TRAIN, "TEST": caffe_pb2.TEST, "ALL": None}
    click.echo(f"Drawing net to {output_image_file}")
    draw.draw_net_to_file(net, output_image_file, rankdir, phases[phase.upper()], display_lrm)


@main.command("split_db")
@click.argument("input_db")
@click.argument("num_shards", type=click.IntRange(min=1))
@click.argument("output_prefix", required=False)
def split_db(input_db, num_shards, output_prefix):
    """Split an LMDB or LevelDB into N shards (of its kind) for split-DB multi-node training."""
    from .parallel import split_db as splitter
    splitter.split_db(input_db, num_shards, output_prefix)


# -- Caffe's python/ and tools/extra/ scripts (classify.py, detect.py, summarize.py,
#    plot_training_log.py, resize_and_crop_images.py): their arguments, their spellings ---------------
_GPU_SWITCH_HELP = "Accepted for Caffe's scripts and ignored with a warning: caffepy runs on the CPU."


def _script_options(f):
    """The preprocessing flags classify.py and detect.py share, with their defaults."""
    from .classifier import IMAGENET_MEAN, REFERENCE_DEPLOY, REFERENCE_WEIGHTS
    for option in reversed([
            click.option("--model_def", default=REFERENCE_DEPLOY, show_default=True, metavar="FILE",
                         help="Model definition file (the default: from a Caffe tree's root)."),
            click.option("--pretrained_model", default=REFERENCE_WEIGHTS, show_default=True, metavar="FILE",
                         help="Trained model weights file."),
            click.option("--gpu", is_flag=True, help=_GPU_SWITCH_HELP),
            click.option("--mean_file", default=IMAGENET_MEAN, show_default=True, metavar="FILE",
                         help="Data set image mean: a .npy of K x H x W or K values, or a .binaryproto; "
                              "'' for no mean subtraction."),
            click.option("--input_scale", type=float, help="Multiply input features by this scale to "
                                                            "finish preprocessing."),
            click.option("--raw_scale", type=float, default=255.0, show_default=True,
                         help="Multiply raw input by this scale before preprocessing."),
            click.option("--channel_swap", default="2,1,0", show_default=True,
                         help="Order to permute input channels; the default converts RGB to BGR, "
                              "Caffe's order.")]):
        f = option(f)
    return f


def _gpu_switch(gpu):
    if gpu:
        log.warning("caffepy runs on the CPU; ignoring --gpu")


@main.command()
@click.argument("input_file")
@click.argument("output_file")
@_script_options
@click.option("--center_only", is_flag=True,
              help="Predict from the centre crop alone instead of averaging ten crops (the default).")
@click.option("--images_dim", default="256,256", show_default=True,
              help="Canonical 'height,width' the images are resized to before cropping.")
@click.option("--ext", default="jpg", show_default=True,
              help="Image file extension to take as input when INPUT_FILE is a folder.")
def classify(input_file, output_file, model_def, pretrained_model, gpu, mean_file, input_scale, raw_scale,
             channel_swap, center_only, images_dim, ext):
    """Classify INPUT_FILE (an image, a folder of them, or a .npy of H x W x K images) and save the
    N x classes predictions to OUTPUT_FILE (.npy), as Caffe's python/classify.py."""
    _gpu_switch(gpu)
    from . import classifier
    classifier.classify(input_file, output_file, model_def, pretrained_model, center_only=center_only,
                        images_dim=images_dim, mean_file=mean_file, input_scale=input_scale,
                        raw_scale=raw_scale, channel_swap=channel_swap, ext=ext)


@main.command()
@click.argument("input_file")
@click.argument("output_file")
@_script_options
@click.option("--crop_mode", type=click.Choice(["list", "selective_search"]), default="selective_search",
              show_default=True, help="How to get the windows: a .csv's list, or Selective Search's "
                                      "proposals for the images a .txt lists.")
@click.option("--context_pad", type=click.IntRange(min=0), default=16, show_default=True,
              help="Pixels of surrounding context to take around each window.")
def detect(input_file, output_file, model_def, pretrained_model, gpu, mean_file, input_scale, raw_scale,
           channel_swap, crop_mode, context_pad):
    """Classify windows of images, as Caffe's python/detect.py: INPUT_FILE is a .csv of windows
    (header filename, xmin, ymin, xmax, ymax) or a .txt of image files; OUTPUT_FILE's extension
    chooses .csv, .h5 or .npy."""
    _gpu_switch(gpu)
    from . import detector
    detector.detect(input_file, output_file, model_def, pretrained_model, crop_mode=crop_mode,
                    mean_file=mean_file, input_scale=input_scale, raw_scale=raw_scale,
                    channel_swap=channel_swap, context_pad=context_pad)


@main.command()
@click.argument("filename", metavar="NET.prototxt")
@click.option("-w", "--max-width", "max_width", type=click.IntRange(min=1), default=30, show_default=True,
              help="Maximum field width.")
@click.option("--phase", type=click.Choice(["TRAIN", "TEST"], case_sensitive=False), default="TEST",
              show_default=True, help="The phase whose layers are listed (and built, for the sizes).")
@click.option("--level", default=0, type=int, help="Net level, for include/exclude rules.")
@click.option("--stage", multiple=True, help="Net stage(s), comma-separated.")
def summarize(filename, max_width, phase, level, stage):
    """Print a concise summary of a net, as Caffe's tools/extra/summarize.py: each layer's name,
    type, param specs, bottoms -> tops and window, then its top shapes, parameters, forward
    FLOPs and memory, and the totals (the sizes need the net built: its data sources present)."""
    from . import summarize as tool
    tool.summarize(filename, phase=phase.upper(), level=level, stages=_stages(stage), max_width=max_width)


@main.command("resize_and_crop_images")
@click.option("--input_folder", default="", metavar="DIR",
              help="The folder that holds the input images (in subfolders, e.g. by synset).")
@click.option("--output_folder", required=True, metavar="DIR",
              help="The folder the resized and cropped images go to, at the same relative paths.")
@click.option("--output_side_length", type=int, default=256, show_default=True,
              help="Side length of the output images.")
@click.option("--input", "input_list", metavar="FILE",
              help="A file of image paths relative to --input_folder, one a line (a trailing label is "
                   "ignored); without it, every image under --input_folder.")
@click.option("--image_lib", type=click.Choice(["opencv"], case_sensitive=False), default="opencv",
              show_default=True, help="Caffe's choice of library; caffepy resizes with OpenCV.")
@click.option("--num_clients", type=click.IntRange(min=1), metavar="N",
              help="Images done at once (Caffe's mapreduce clients); default: one per core.")
def resize_and_crop_images(input_folder, output_folder, output_side_length, input_list, image_lib,
                           num_clients):
    """Scale each image so its short side is --output_side_length, then keep its centre square
    (Caffe's tools/extra/resize_and_crop_images.py, without its mapreduce)."""
    from .data import tools
    tools.resize_and_crop_images(input_folder, output_folder, output_side_length, input_list, num_clients)


# Every flag of Caffe's and Intel Caffe's tools/caffe.cpp, with its gflags type. gflags are global:
# `caffe test -phase TRAIN` runs and the action reads only the flags it needs.
CAFFE_FLAGS = {"gpu": str, "solver": str, "model": str, "phase": str, "level": int, "stage": str,
               "snapshot": str, "weights": str, "iterations": int, "sigint_effect": str,
               "sighup_effect": str, "forward_only": bool, "engine": str, "collect_dir": str,
               "compare_output_dir": str, "epsilon": float, "detection": bool, "fast_compare": bool,
               "sampling": bool, "fast_compare_max": int, "buffer_filler": float, "n_group": int,
               "n_server": int}


def take_every_caffe_flag(command):
    """Give `command` the Caffe flags it lacks, hidden, type-checked, and ignored with a warning."""
    own = {p.name for p in command.params}
    extra = [name for name in CAFFE_FLAGS if name not in own]
    for name in extra:
        kind = CAFFE_FLAGS[name]
        if kind is bool:
            option = click.Option([f"--{name}/--no-{name}"], default=False, hidden=True)
        else:
            option = click.Option([f"--{name}"], type=kind, hidden=True)
        command.params.append(option)
    run = command.callback

    @functools.wraps(run)
    def without_extra(**kwargs):
        ctx = click.get_current_context()
        for name in extra:
            value = kwargs.pop(name)
            if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE:
                shown = ("" if value else "=false") if CAFFE_FLAGS[name] is bool else f" {value}"
                log.warning(f"caffepy {command.name}: -{name}{shown} means nothing for {command.name}; "
                            f"ignored, as Caffe does")
        return run(**kwargs)
    command.callback = without_extra


for _command in (train, test, time, collect, compare, device_query):
    take_every_caffe_flag(_command)


def _gpu_notice(gpu):
    if gpu is None:
        return
    if gpu != "all" and not re.fullmatch(r"\d+(,\d+)*", gpu):
        raise click.BadParameter(f"expected 'all' or comma-separated device ids, got '{gpu}'",
                                 param_hint="--gpu")
    log.warning(f"caffepy runs on the CPU; ignoring --gpu {gpu}")


if __name__ == "__main__":
    main()
