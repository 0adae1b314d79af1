"""mkdocs hook (mkdocs.yml `hooks:`): links from docs/ to files of the repository outside it.

The guides link on purpose to files beside docs/ (`../results/README.md`): they resolve on
GitHub, not in the built site. mkdocs reports such a link as it reports a missing page
(`validation.links.not_found`), so that setting cannot keep one and fail the other. This
hook lowers the report to INFO for a link that leaves docs/ and names a file that exists;
a missing page inside docs/, or a missing file outside it, still fails `mkdocs build --strict`.
"""

import logging
import os
import posixpath
import re
from urllib.parse import unquote, urlsplit

# mkdocs.structure.pages.Page.path_to_url's wording (mkdocs 1.6). If it changes, nothing
# matches and every such link fails the strict build again: the filter never hides a link.
_NOT_FOUND = re.compile(
    r"Doc file '(?P<page>[^']+)' contains a link '(?P<url>[^']+)', but the target"
    r".* is not found among documentation files\."
)


class _OutsideDocsLinks(logging.Filter):
    def __init__(self, docs_dir):
        super().__init__()
        self.docs_dir = os.path.abspath(docs_dir)

    def filter(self, record):
        match = _NOT_FOUND.match(record.getMessage())
        if match and record.levelno > logging.INFO and self._outside_and_present(match):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True

    def _outside_and_present(self, match):
        path = unquote(urlsplit(match["url"]).path)
        relative = posixpath.normpath(posixpath.join(posixpath.dirname(match["page"]), path))
        if not relative.startswith("../"):
            return False  # inside docs/: a missing page, which must fail
        return os.path.exists(os.path.join(self.docs_dir, *relative.split("/")))


def on_config(config):
    """Installs the filter on the logger of mkdocs's link validation.

    Args:
        config: the mkdocs configuration (its `docs_dir`).

    Returns:
        `config`, unchanged.
    """
    logger = logging.getLogger("mkdocs.structure.pages")
    for old in [f for f in logger.filters if type(f).__name__ == "_OutsideDocsLinks"]:
        logger.removeFilter(old)  # `mkdocs serve` loads the hook again on each rebuild
    logger.addFilter(_OutsideDocsLinks(config["docs_dir"]))
    return config
