"""`python -m tf_asgd.launch`: the launcher's entry point (see `tf_asgd.launch.main`)."""

import sys

from absl import app, flags

from tf_asgd.launch import main, process

__doc__ = main.__doc__  # absl prints the main module's docstring as --help's usage
flags.adopt_module_key_flags(main)  # and lists the key flags of the main module only

process.set_tf_log_level(sys.argv)
app.run(main.main, flags_parser=main.parse_flags)
