"""epcomm's PEP 517 build backend: setuptools' own (``setuptools.build_meta``), plus one file.

Every wheel it builds, the normal one (``pip install .``) and the editable one (``pip install -e .``,
PEP 660), gets ``epcomm_as_deep_ep.pth`` at its root, with a ``RECORD`` line, so pip installs it into
site-packages and uninstalls it with the package. That file is the hook of the switch
``EPCOMM_AS_DEEP_EP`` (``src/_epcomm_as_deep_ep.py`` explains it). Why here and not in a setuptools
command: setuptools' editable wheels carry only a path ``.pth`` (or an import finder) and drop any
other file a build step makes, so a ``.pth`` has to be added to the finished wheel; the PEP 517 hooks
are the one place that sees both kinds of wheel. Everything else is setuptools, unchanged.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # every hook we do not wrap is setuptools' own

PTH_NAME = "epcomm_as_deep_ep.pth"
# One line, run by ``site`` in every process: a dictionary look-up unless the variable is set.
PTH_TEXT = 'import os; "EPCOMM_AS_DEEP_EP" in os.environ and __import__("_epcomm_as_deep_ep").install()\n'


def add_pth(wheel_path: str, name: str = PTH_NAME, text: str = PTH_TEXT) -> None:
    """Rewrite the wheel at ``wheel_path`` with ``name`` (content ``text``) at its root, listed in RECORD."""
    data = text.encode()
    with zipfile.ZipFile(wheel_path) as zin:
        entries = [(info, zin.read(info)) for info in zin.infolist()]
    if any(info.filename == name for info, _ in entries):
        return
    records = [info for info, _ in entries if info.filename.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise ValueError(f"{wheel_path} has {len(records)} .dist-info/RECORD files, expected one")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    line = f"{name},sha256={digest},{len(data)}\n".encode()
    pth = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    pth.compress_type = zipfile.ZIP_DEFLATED
    pth.external_attr = 0o644 << 16
    tmp = wheel_path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        zout.writestr(pth, data)
        for info, blob in entries:  # RECORD stays last, as the wheel format asks
            zout.writestr(info, line + blob if info is records[0] else blob)
    os.replace(tmp, wheel_path)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name
