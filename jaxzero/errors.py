"""Bad input, as opposed to bugs: every error a user can fix by changing a config,
a flag, a file or a path derives from :class:`UserError`.

The command-line tools report a UserError as one line, ``prog: error: ...``,
and exit with code 2, before anything expensive runs where they can.
"""

from __future__ import annotations


class UserError(ValueError):
  """Bad user input; the message names what is wrong and the valid choices."""


class ConfigError(UserError):
  """A config key, value or combination that cannot run."""


class DataError(UserError):
  """Bad data input: the message names the file or the data.* setting."""


class CheckpointError(UserError):
  """A checkpoint that is missing, damaged or does not fit, or an export that
  cannot go ahead: one line naming the leaf or file."""


class DamagedCheckpointError(CheckpointError):
  """A checkpoint whose files cannot be read or whose values fail verification
  (as opposed to one that does not fit the config)."""


class PathError(UserError):
  """A workdir, checkpoint, data-cache or export path that cannot be used."""


class WorkdirInUse(PathError):
  """Another live run holds the workdir's lock."""


class NonFiniteError(UserError):
  """Training met a non-finite loss or gradient norm (train.nonfinite says when
  to stop); the state and checkpoints stay finite."""


class HFCheckpointError(UserError):
  """A Hugging Face checkpoint that cannot be loaded; names the file or tensor."""
