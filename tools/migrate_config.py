"""Rewrites a gin config of an older tfdp into today's bindings, in place (or prints it).

Older configs bound every setting as an argument of the trainer
(`tfdp.train_and_evaluate.batch_size = %BATCH_SIZE`); the settings are now
grouped by concern in small config objects (`tfdp.configs`:
`tfdp.OptimizationConfig.batch_size = %BATCH_SIZE`). This renames each old
binding to its new home (`tfdp.configs.MOVED`) and leaves everything else,
comments, macros and `--gin_param`-style lines included, as it was.
`model_fn` and `privacy` stay arguments of `tfdp.train_and_evaluate`.

  python tools/migrate_config.py my_experiment.gin           # rewrites the file
  python tools/migrate_config.py --dry_run my_experiment.gin # prints the changes only

The file is replaced atomically (written beside it, then renamed over it, keeping its mode).

Exits 1 with one "error: ..." line on a file it cannot read or write.
"""

import re
import sys

from absl import app
from absl import flags

_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print each renamed binding; change nothing.")


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("Name one or more gin files to migrate.")
    texts = {}
    for path in argv[1:]:  # all read before anything is written (or TensorFlow imported)
        try:
            with open(path, encoding="utf-8") as f:
                texts[path] = f.read()
        except (OSError, UnicodeDecodeError) as e:
            print(f"error: cannot read {path}: {getattr(e, 'strerror', None) or e}",
                  file=sys.stderr)
            sys.exit(1)
    from tfdp import atomic_file  # pylint: disable=g-import-not-at-top
    from tfdp import configs  # pylint: disable=g-import-not-at-top

    for path, text in texts.items():
        found = configs.old_bindings(text)
        for old, new in found:
            print(f"{path}: {old} -> {new}")
        if not found:
            print(f"{path}: nothing to migrate")
        if any(old.endswith(".sampling_seed") for old, _ in found) and re.search(
                r"train_and_evaluate\.privacy\s*=\s*None", text):
            print(f"{path}: note: this config trains WITHOUT privacy, whose batches now follow "
                  "tfdp.RuntimeConfig.seed; its sampling_seed (now a tfdp.PrivacyConfig "
                  "setting) is listed as not used. Bind tfdp.RuntimeConfig.seed to fix them.")
        if found and not _DRY_RUN.value:
            try:
                # Beside the file, then renamed over it: a full disk never leaves half a file.
                atomic_file.write_text(path, configs.migrate(text))
            except OSError as e:
                print(f"error: cannot write {path} (left as it was): {e.strerror}",
                      file=sys.stderr)
                sys.exit(1)


if __name__ == "__main__":
    app.run(main)
