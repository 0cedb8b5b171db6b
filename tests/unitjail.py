"""The shipped systemd unit, emulated for CI without a running systemd.

``python -m tests.unitjail [--home HOME] UNIT USER BIND -- ARGV...`` runs ARGV the way the
unit file UNIT would have systemd run it, as far as what the process can do is concerned:

* in a private mount namespace (``PrivateMounts=``): ``ProtectProc=`` mounts a /proc of
  its own, ``ProtectKernelTunables=`` and ``ProtectKernelLogs=`` cover the files systemd
  252 covers under it (read-only binds, inaccessible files: mounts that are locked for
  any user namespace made inside, which is what stops bwrap's ``--proc``),
  ``ProtectControlGroups=`` makes the cgroup tree read-only, ``PrivateTmp=`` gives /tmp
  a tmpfs of its own (BIND, the daemon's folder, is bound back at its path: the unit's
  ``StateDirectory=``/``ReadWritePaths=``; each ``BindReadOnlyPaths=`` is bound back
  read-only at its path, as systemd makes those mounts after ``PrivateTmp=``'s, from
  the host's paths), ``ProtectHome=`` empties /home, /root and
  /run/user (the Python installation is bound back: the unit expects agentd in
  /opt/agentd/venv, outside any home);
* ``PrivateIPC=`` and ``ProtectHostname=``: IPC and UTS namespaces of its own;
* ``CapabilityBoundingSet=`` emptied, then ``User=``/``Group=`` (supplementary groups
  none), ``UMask=``, ``NoNewPrivileges=``, and HOME, USER, LOGNAME and SHELL from the
  user's passwd entry, as systemd sets them (``--home``: the user's home is HOME, as if
  made by the ``useradd --home-dir /var/lib/agentd`` of the unit's header: USER here is
  one the machine already has);
* every seccomp directive, loaded through libseccomp (ctypes on ``libseccomp.so.2``) as
  filters of their own, as systemd loads them: ``SystemCallFilter=`` (its groups
  expanded by ``systemd-analyze syscall-filter``, ``@default`` added to an allow list)
  with ``SystemCallErrorNumber=``, ``SystemCallArchitectures=native`` (a filter for the
  native architecture only: any other is killed), ``RestrictNamespaces=`` (unshare and
  clone by their ``CLONE_NEW*`` flags, setns by its type, clone3 ENOSYS),
  ``RestrictAddressFamilies=``, ``MemoryDenyWriteExecute=``, ``RestrictRealtime=``,
  ``RestrictSUIDSGID=``, ``LockPersonality=``, and the seccomp parts of
  ``ProtectKernelModules=``, ``ProtectClock=``, ``ProtectHostname=``,
  ``ProtectKernelLogs=`` and ``PrivateDevices=``.

Every directive of a unit is either in ``MODELLED`` (applied here) or in ``UNMODELLED``
with the reason it does not change what a tool or bwrap can do in the test; a directive
in neither stops the jail (``unmodelled``), so the unit cannot gain one unnoticed.

Needs root (to build the namespace, then drop to USER), libseccomp and systemd-analyze:
``why_not()`` says what is missing. ``old_unit`` turns a unit back into the one that
shipped before bwrap was allowed in it (the control of the trust class).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

# -- the directives -------------------------------------------------------------------------

#: Applied by the jail, each to the effect systemd gives it.
MODELLED = frozenset(
    {
        "User", "Group", "UMask", "StateDirectory", "StateDirectoryMode", "ReadWritePaths",
        "NoNewPrivileges", "CapabilityBoundingSet", "AmbientCapabilities", "BindReadOnlyPaths",
        "PrivateMounts", "PrivateTmp", "ProtectHome", "PrivateIPC", "ProtectHostname",
        "ProtectProc", "ProtectKernelTunables", "ProtectKernelLogs", "ProtectControlGroups",
        "ProtectKernelModules", "ProtectClock", "PrivateDevices",
        "SystemCallFilter", "SystemCallErrorNumber", "SystemCallArchitectures",
        "RestrictNamespaces", "RestrictAddressFamilies", "MemoryDenyWriteExecute",
        "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality",
    }
)  # fmt: skip

#: Not applied, each with why that leaves the emulation true to what a tool can do.
UNMODELLED = {
    # what the manager does around the process, not what the process may do
    "Description": "text",
    "Wants": "ordering at boot",
    "After": "ordering at boot",
    "WantedBy": "enablement",
    "Type": "readiness protocol (the test waits for supervisor.json)",
    "NotifyAccess": "readiness protocol",
    "ExecStart": "the jail runs the command it is given",
    "ExecReload": "how systemctl reload signals",
    "WatchdogSec": "the manager's liveness check",
    "Restart": "the manager's restart policy",
    "RestartSec": "the manager's restart policy",
    "RestartPreventExitStatus": "the manager's restart policy",
    "KillMode": "how the manager stops the service",
    "TimeoutStopSec": "how the manager stops the service",
    "RemoveIPC": "clean-up after the service stops",
    "Environment": "the test names its config on the command line",
    "EnvironmentFile": "the test gives the environment itself",
    "LoadCredential": "the test gives no API key (scripted model)",
    "Delegate": "the cgroup subtree: the jail runs in the caller's cgroup, and the daemon "
    "says `cgroups: none` when it cannot have one",
    # mount-namespace settings that leave a tool's and bwrap's reach as it is here
    "ProtectSystem": "/ read-only to the daemon's user: it is not root, and bwrap binds / "
    "read-only for tools anyway",
    "PrivateUsers": "a user namespace mapping the service's user and root: bwrap nests its "
    "own inside, and the mounts above are locked for it all the same",
    "DevicePolicy": "the device cgroup: bwrap gives tools a /dev of its own",
    "KeyringMode": "the session keyring, which agentd does not use",
}


def directives(text: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit, by key, in order (keys may repeat)."""
    found: dict[str, list[str]] = defaultdict(list)
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found[key.strip()].append(value.strip())
    return found


def unmodelled(text: str) -> list[str]:
    """The directives of unit ``text`` the jail neither applies nor accounts for."""
    return sorted(set(directives(text)) - MODELLED - set(UNMODELLED))


def old_unit(text: str) -> str:
    """The unit as it shipped before it let bwrap work: namespaces refused, no netlink,
    bwrap's calls not allowed again, /proc covered, the cgroup tree read-only."""
    out = []
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "RestrictNamespaces":
            out.append("RestrictNamespaces=yes")
        elif key in ("ProtectKernelTunables", "ProtectKernelLogs", "ProtectControlGroups"):
            out.append(f"{key}=yes")
        elif key == "RestrictAddressFamilies":
            out.append("RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6")
        elif not (key == "SystemCallFilter" and value.split()[0] == "mount") and key != "Delegate":
            out.append(line)
    return "\n".join(out) + "\n"


def _yes(value: str) -> bool:
    return value.lower() in ("yes", "true", "1", "on")


# -- what the machine has -------------------------------------------------------------------


@functools.cache
def libseccomp() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
    ]  # fmt: skip
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    return lib


def why_not() -> str | None:
    """Why this machine cannot build the jail, or None."""
    if os.geteuid() != 0:
        return "the emulated unit needs root (to build its namespace, then drop to a user)"
    if libseccomp() is None:
        return "libseccomp.so.2 is not installed"
    if shutil.which("systemd-analyze") is None:
        return "systemd-analyze is not installed (it expands the syscall groups)"
    if shutil.which("bwrap") is None:
        return "bwrap is not installed"
    return None


@functools.cache
def syscall_groups() -> dict[str, list[str]]:
    """``systemd-analyze syscall-filter``: each group's members (calls and groups)."""
    done = subprocess.run(
        ["systemd-analyze", "syscall-filter", "--no-pager"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in done.stdout.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif not line.strip() or not line.startswith(" "):
            current = None
        elif current is not None and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def expand(names: list[str]) -> set[str]:
    """System call names, with every ``@group`` expanded (recursively)."""
    groups = syscall_groups()
    out: set[str] = set()
    for name in names:
        if name.startswith("@"):
            if name not in groups:
                raise ValueError(f"unknown syscall group {name}")
            out |= expand(groups[name])
        else:
            out.add(name)
    return out


def allowed_calls(values: list[str]) -> tuple[bool, set[str]]:
    """``SystemCallFilter=`` lines as systemd reads them: (an allow list?, the calls).
    The first line decides: an allow list gets ``@default``; later lines add to the list
    of its kind, or with ``~`` take away from it."""
    allow: bool | None = None
    calls: set[str] = set()
    for value in values:
        if not value:
            allow, calls = None, set()
            continue
        invert = value.startswith("~")
        names = expand(value.removeprefix("~").split())
        if allow is None:
            allow = not invert
            calls = names | (expand(["@default"]) if allow else set())
        elif invert == (not allow):
            calls |= names
        else:
            calls -= names
    return (allow if allow is not None else False), calls


# -- seccomp ------------------------------------------------------------------------------

ACT_ALLOW = 0x7FFF0000
CMP_NE, CMP_EQ, CMP_GT, CMP_MASKED_EQ = 1, 4, 6, 7
FLTATR_CTL_NNP = 3


def act_errno(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)


class ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


#: (argument, comparison, value): one condition of a rule (MASKED_EQ: all the bits set).
Cond = tuple[int, int, int]


class Filter:
    """One seccomp filter (libseccomp), native architecture only."""

    def __init__(self, default: int) -> None:
        lib = libseccomp()
        assert lib is not None
        self.lib = lib
        self.ctx = lib.seccomp_init(default)
        lib.seccomp_attr_set(self.ctx, FLTATR_CTL_NNP, 0)  # (set by the jail itself)

    def rule(self, action: int, name: str, *conds: Cond) -> None:
        number = self.lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a call of this architecture (setgroups32 on x86_64, ...)
            return
        array = (ArgCmp * max(1, len(conds)))()
        for i, (arg, op, value) in enumerate(conds):
            # (MASKED_EQ: datum_a is the mask, datum_b the value it must equal)
            array[i] = ArgCmp(arg, op, value, value if op == CMP_MASKED_EQ else 0)
        result = self.lib.seccomp_rule_add_array(self.ctx, action, number, len(conds), array)
        if result not in (0, -errno.EEXIST, -errno.EACCES):  # (EACCES: the default action)
            raise OSError(-result, f"seccomp rule for {name}: {os.strerror(-result)}")

    def load(self) -> None:
        result = self.lib.seccomp_load(self.ctx)
        if result != 0:
            raise OSError(-result, f"seccomp_load: {os.strerror(-result)}")


NAMESPACES = {
    "cgroup": 0x02000000, "ipc": 0x08000000, "net": 0x40000000, "mnt": 0x00020000,
    "pid": 0x20000000, "user": 0x10000000, "uts": 0x04000000,
}  # fmt: skip


def _families(names: list[str]) -> set[int]:
    import socket

    return {int(getattr(socket, name)) for name in names}


AF_MAX = 46
PROT_WRITE, PROT_EXEC, SHM_EXEC = 0x2, 0x4, 0o100000
S_ISUID, S_ISGID = 0o4000, 0o2000
O_CREAT = 0o100
SCHED_FIFO, SCHED_RR, SCHED_IDLE = 1, 2, 5


def filters(unit: dict[str, list[str]]) -> list[Filter]:
    """The seccomp filters ``unit`` has systemd load, in its order."""
    out: list[Filter] = []
    eperm = act_errno(errno.EPERM)
    denied: set[str] = set()
    for key, group in (
        ("ProtectKernelModules", "@module"),
        ("ProtectClock", "@clock"),
        ("PrivateDevices", "@raw-io"),
    ):
        if _yes(_last(unit, key)):
            denied |= expand([group])
    if _yes(_last(unit, "ProtectHostname")):
        denied |= {"sethostname", "setdomainname"}
    if _yes(_last(unit, "ProtectKernelLogs")):
        denied.add("syslog")
    if denied:
        f = Filter(ACT_ALLOW)
        for name in sorted(denied):
            f.rule(eperm, name)
        out.append(f)
    if (value := _last(unit, "RestrictNamespaces")) and value.lower() not in ("no", "false"):
        out.append(_namespace_filter(value))
    if families := unit.get("RestrictAddressFamilies"):
        allowed = _families(families[-1].split())
        f = Filter(ACT_ALLOW)
        nosupport = act_errno(errno.EAFNOSUPPORT)
        for af in range(AF_MAX):
            if af not in allowed:
                f.rule(nosupport, "socket", (0, CMP_EQ, af))
        f.rule(nosupport, "socket", (0, CMP_GT, AF_MAX - 1))
        out.append(f)
    if _yes(_last(unit, "MemoryDenyWriteExecute")):
        f = Filter(ACT_ALLOW)
        f.rule(eperm, "mmap", (2, CMP_MASKED_EQ, PROT_WRITE | PROT_EXEC))
        f.rule(eperm, "mprotect", (2, CMP_MASKED_EQ, PROT_EXEC))
        f.rule(eperm, "pkey_mprotect", (2, CMP_MASKED_EQ, PROT_EXEC))
        f.rule(eperm, "shmat", (2, CMP_MASKED_EQ, SHM_EXEC))
        out.append(f)
    if _yes(_last(unit, "RestrictRealtime")):
        f = Filter(ACT_ALLOW)
        for policy in (SCHED_FIFO, SCHED_RR):
            f.rule(eperm, "sched_setscheduler", (1, CMP_EQ, policy))
        f.rule(eperm, "sched_setscheduler", (1, CMP_GT, SCHED_IDLE))
        out.append(f)
    if _yes(_last(unit, "RestrictSUIDSGID")):
        out.append(_suid_filter())
    if _yes(_last(unit, "LockPersonality")):
        f = Filter(ACT_ALLOW)
        f.rule(eperm, "personality", (0, CMP_NE, 0))  # PER_LINUX
        out.append(f)
    # The syscall filter last, as systemd loads it: it may refuse seccomp() itself.
    errnos = unit.get("SystemCallErrorNumber", [])
    refusal = act_errno(getattr(errno, errnos[-1])) if errnos else 0  # 0: kill the thread
    if unit.get("SystemCallFilter"):
        allow, calls = allowed_calls(unit["SystemCallFilter"])
        f = Filter(refusal if allow else ACT_ALLOW)
        for name in sorted(calls):
            f.rule(ACT_ALLOW if allow else refusal, name)
        out.append(f)
    return out


def _namespace_filter(value: str) -> Filter:
    """``RestrictNamespaces=``: yes (none), or the list allowed (``~``: the list refused)."""
    if _yes(value):
        refused = set(NAMESPACES)
    elif value.startswith("~"):
        refused = set(value[1:].split())
    else:
        refused = set(NAMESPACES) - set(value.split())
    eperm = act_errno(errno.EPERM)
    f = Filter(ACT_ALLOW)
    f.rule(act_errno(errno.ENOSYS), "clone3")  # (its flags are out of a filter's reach)
    if refused:
        f.rule(eperm, "setns", (1, CMP_EQ, 0))  # "any type" could be a refused one
    for name in sorted(refused):
        flag = NAMESPACES[name]
        f.rule(eperm, "unshare", (0, CMP_MASKED_EQ, flag))
        f.rule(eperm, "clone", (0, CMP_MASKED_EQ, flag))
        f.rule(eperm, "setns", (1, CMP_MASKED_EQ, flag))
    return f


def _suid_filter() -> Filter:
    """``RestrictSUIDSGID=``: no file made or turned set-user-ID or set-group-ID (and
    openat2, whose flags a filter cannot see, ENOSYS, as systemd does)."""
    eperm = act_errno(errno.EPERM)
    f = Filter(ACT_ALLOW)
    for bit in (S_ISUID, S_ISGID):
        for name, arg in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("creat", 1)):
            f.rule(eperm, name, (arg, CMP_MASKED_EQ, bit))
        for name, arg in (("mknod", 1), ("mknodat", 2)):
            f.rule(eperm, name, (arg, CMP_MASKED_EQ, bit))
        f.rule(eperm, "open", (1, CMP_MASKED_EQ, O_CREAT), (2, CMP_MASKED_EQ, bit))
        f.rule(eperm, "openat", (2, CMP_MASKED_EQ, O_CREAT), (3, CMP_MASKED_EQ, bit))
    f.rule(act_errno(errno.ENOSYS), "openat2")
    return f


def _last(unit: dict[str, list[str]], key: str) -> str:
    values = unit.get(key)
    return values[-1] if values else ""


# -- mounts -------------------------------------------------------------------------------

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUTS = 0x00020000, 0x08000000, 0x04000000
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38

#: systemd 252 (src/core/namespace.c): what ProtectKernelTunables= makes read-only and
#: inaccessible under /proc, and what ProtectKernelLogs= makes inaccessible.
TUNABLES_READ_ONLY = (
    "/proc/acpi", "/proc/apm", "/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq",
    "/proc/latency_stats", "/proc/mtrr", "/proc/scsi", "/proc/sys", "/proc/sysrq-trigger",
    "/proc/timer_list", "/proc/timer_stats", "/sys",
)  # fmt: skip
TUNABLES_INACCESSIBLE = ("/proc/kallsyms", "/proc/kcore")
LOGS_INACCESSIBLE = ("/proc/kmsg", "/dev/kmsg")
HOMES = ("/home", "/root", "/run/user")


@functools.cache
def libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        libc().mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def read_only(path: str) -> None:
    mount(path, path, None, MS_BIND | MS_REC)
    mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def _mkdirs(path: Path) -> None:
    path.mkdir(mode=0o755, parents=True, exist_ok=True)


def mounts(unit: dict[str, list[str]], bind: Path) -> None:
    """The unit's mount namespace, in this process (root): see the module's doc."""
    _check(libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    kept = os.open(bind, os.O_PATH | os.O_DIRECTORY)  # (bound back after /tmp is covered)
    # (BindReadOnlyPaths=: opened on the host's tree, bound once the rest is mounted)
    named = [p.lstrip("-") for value in unit.get("BindReadOnlyPaths", []) for p in value.split()]
    read_only_binds = {path: os.open(path, os.O_PATH) for path in named if os.path.exists(path)}
    if _yes(_last(unit, "PrivateIPC")):
        _check(libc().unshare(CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")
    if _yes(_last(unit, "ProtectHostname")):
        _check(libc().unshare(CLONE_NEWUTS), "unshare(CLONE_NEWUTS)")
    if _last(unit, "ProtectProc") not in ("", "default"):
        # a /proc of its own (the one below is detached: only the unit's is visible)
        _check(libc().umount2(b"/proc", MNT_DETACH), "umount /proc")
        hidepid = f"hidepid={_last(unit, 'ProtectProc')}"
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, hidepid)
    covered: list[str] = []
    if _yes(_last(unit, "ProtectKernelTunables")):
        for path in TUNABLES_READ_ONLY:
            if os.path.exists(path):
                read_only(path)
        covered += TUNABLES_INACCESSIBLE
    if _yes(_last(unit, "ProtectKernelLogs")):
        covered += LOGS_INACCESSIBLE
    with tempfile.NamedTemporaryFile(prefix="unitjail-inaccessible-") as inaccessible:
        os.chmod(inaccessible.name, 0)  # (systemd's /run/systemd/inaccessible/reg)
        for path in covered:
            if os.path.exists(path):
                mount(inaccessible.name, path, None, MS_BIND)
    if _yes(_last(unit, "ProtectControlGroups")) and os.path.isdir("/sys/fs/cgroup"):
        read_only("/sys/fs/cgroup")
    if _yes(_last(unit, "ProtectHome")):
        # (the unit expects agentd in /opt/agentd/venv, outside any home: this Python is
        # bound back through a descriptor of it opened before its home is covered)
        keep = {p: os.open(p, os.O_PATH) for p in {sys.base_prefix, sys.prefix}}
        for home in HOMES:
            if not os.path.isdir(home):
                continue
            mount("tmpfs", home, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
            for path, fd in keep.items():
                if Path(path).is_relative_to(home):
                    _mkdirs(Path(path))
                    mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        for fd in keep.values():
            os.close(fd)
    if _yes(_last(unit, "PrivateTmp")):
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        if bind.is_relative_to("/tmp"):
            _mkdirs(bind)
            mount(f"/proc/self/fd/{kept}", str(bind), None, MS_BIND | MS_REC)
    os.close(kept)
    for path, fd in read_only_binds.items():
        if not os.path.exists(path):  # (a mount point, in the fresh /tmp)
            _mkdirs(Path(path))
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
        os.close(fd)


def drop_to(user: pwd.struct_passwd, unit: dict[str, list[str]], home: str | None = None) -> None:
    """The unit's identity: no capability left to gain, the user's ids, its umask
    (``home``: the user's home, instead of its passwd entry's)."""
    if _last(unit, "CapabilityBoundingSet") == "":
        last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for cap in range(last_cap + 1):
            _check(libc().prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    os.setgroups([])
    os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
    os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
    if umask := _last(unit, "UMask"):
        os.umask(int(umask, 8))
    os.environ.update(
        HOME=home or user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name, SHELL=user.pw_shell
    )
    # (set for any seccomp filter of an unprivileged process; NoNewPrivileges=yes too)
    _check(libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def main(argv: list[str]) -> int:
    home = None
    if argv[:1] == ["--home"] and len(argv) > 1:
        home, argv = argv[1], argv[2:]
    if len(argv) < 5 or argv[3] != "--":
        usage = "usage: python -m tests.unitjail [--home HOME] UNIT USER BIND -- ARGV..."
        print(usage, file=sys.stderr)
        return 2
    text = Path(argv[0]).read_text()
    if missing := unmodelled(text):
        print(f"unitjail: the unit has directives it does not model: {missing}", file=sys.stderr)
        return 78
    unit = directives(text)
    user = pwd.getpwnam(argv[1])
    loaded = filters(unit)  # (systemd-analyze runs before the namespace is made)
    mounts(unit, Path(argv[2]).resolve())
    drop_to(user, unit, home)
    for f in loaded:
        f.load()
    os.execvp(argv[4], argv[4:])  # noqa: S606  (an argv, as systemd's ExecStart= runs it)


def command(
    unit: Path, user: str, bind: Path, argv: list[str], *, home: Path | None = None
) -> list[str]:
    """The argv that runs ``argv`` in the jail (``home``: the user's home there)."""
    homed = ["--home", str(home)] if home is not None else []
    return [sys.executable, "-m", "tests.unitjail", *homed, str(unit), user, str(bind), "--", *argv]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
