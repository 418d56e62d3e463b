"""The Flink job server patch (refinery.runners.flink_private): the class-file redirect, the jar
checks, and the embedded Flink's private TLS configuration. The whole patched JVM is probed as
another user in tests/test_runner_sockets.py::test_a_flink_run."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest
from test_flink import flink_jar  # noqa: F401  # the fixture: the jar, or skip (fail under CI)

from refinery.runners import flink_local
from refinery.runners.flink_private import (
    MARKER,
    PATCH_ID,
    JarPatchError,
    embedded_flink_conf,
    grpc_package,
    is_patched,
    patch_jar,
    redirect_calls,
)

needs_jdk = pytest.mark.skipif(not (shutil.which("javac") and shutil.which("java") and shutil.which("keytool")),
                               reason="no JDK (javac, java, keytool) on PATH")

PROGRAM = {
    "Builder.java": 'class Builder { static String forPort(int p) { return "builder " + p; }\n'
                    '  static String other(int p) { return "other " + p; } }\n',
    "Target.java": 'class Target { static String forPort(int p) { return "target " + p; } }\n',
    "Main.java": 'public class Main { public static void main(String[] a) {\n'
                 '  System.out.println(Builder.forPort(7)); System.out.println(Builder.other(8)); } }\n',
}


@needs_jdk
def test_the_redirected_call_runs_the_target_and_nothing_else(tmp_path: Path) -> None:
    for name, text in PROGRAM.items():
        (tmp_path / name).write_text(text)
    subprocess.run(["javac", "-d", str(tmp_path), *(str(tmp_path / n) for n in PROGRAM)], check=True)

    def run() -> list[str]:
        return subprocess.run(["java", "-cp", str(tmp_path), "Main"], check=True, capture_output=True,
                              text=True).stdout.split("\n")[:2]

    assert run() == ["builder 7", "other 8"]
    main = tmp_path / "Main.class"
    data, hits = redirect_calls(main.read_bytes(), "Builder", {"forPort": "(I)Ljava/lang/String;"}, "Target")
    assert hits == 1
    main.write_bytes(data)
    assert run() == ["target 7", "other 8"]  # the JVM verified the class; only forPort moved
    again, hits = redirect_calls(data, "Builder", {"forPort": "(I)Ljava/lang/String;"}, "Target")
    assert hits == 0 and again == data
    wrong, hits = redirect_calls(data, "Target", {"forPort": "(J)Ljava/lang/String;"}, "Builder")
    assert hits == 0  # another descriptor: left alone


def test_not_a_class_file_is_refused() -> None:
    with pytest.raises(JarPatchError, match="not a class file"):
        redirect_calls(b"PK\x03\x04", "a/B", {"forPort": "(I)V"}, "c/D")


def _zip(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return path


def test_which_jars_count_as_patched(tmp_path: Path) -> None:
    assert not is_patched(_zip(tmp_path / "plain.jar", {"a.class": b"x"}))
    assert is_patched(_zip(tmp_path / "ok.jar", {MARKER: (PATCH_ID + "\n").encode()}))
    assert not is_patched(_zip(tmp_path / "old.jar", {MARKER: b"private-servers-0\n"}))  # an older patch: redone
    assert not is_patched(tmp_path / "missing.jar")
    (tmp_path / "junk.jar").write_bytes(b"PK")
    assert not is_patched(tmp_path / "junk.jar")


def test_a_jar_of_an_unknown_beam_is_refused_by_name(tmp_path: Path) -> None:
    builder = "org/apache/beam/vendor/grpc/v1p99p0/io/grpc/netty/NettyServerBuilder.class"
    assert grpc_package([builder, "x.class"]) == "org/apache/beam/vendor/grpc/v1p99p0/io/grpc"
    with pytest.raises(JarPatchError, match="expected one vendored gRPC NettyServerBuilder"):
        grpc_package(["x.class"])
    jar = _zip(tmp_path / "beam-runners-flink-1.19-job-server-9.9.9.jar", {builder: b"\xca\xfe\xba\xbe"})
    if shutil.which("javac") and shutil.which("jar"):
        with pytest.raises(JarPatchError, match=r"no NettyServerBuilder.forPort/forAddress call to redirect in "
                                             r"org/apache/beam/sdk/fn/server/ServerFactory\$InetSocketAddress"):
            patch_jar(jar)
    with pytest.raises(JarPatchError, match="no such job server jar"):
        flink_local.private_job_server(str(tmp_path / "nowhere.jar"), cache=tmp_path / "cache")


@needs_jdk
def test_the_embedded_flinks_configuration_is_private_and_made_once(tmp_path: Path) -> None:
    folder = embedded_flink_conf(tmp_path, log=lambda line: None)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    conf, keystore = folder / "config.yaml", folder / "keystore.p12"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600 and stat.S_IMODE(keystore.stat().st_mode) == 0o600
    text = conf.read_text()
    for line in ("rest.bind-address: localhost", "security.ssl.rest.enabled: true",
                 "security.ssl.rest.authentication-enabled: true", "security.ssl.internal.enabled: true",
                 f"security.ssl.internal.keystore: {keystore}"):
        assert line in text.splitlines(), line
    key = keystore.read_bytes()
    assert embedded_flink_conf(tmp_path, log=lambda line: None) == folder and keystore.read_bytes() == key
    assert folder.name == f"tls-{os.getuid()}"  # one per user: a shared cache keeps each user's key apart


def test_the_fetched_job_server_is_patched(flink_jar: Path) -> None:  # noqa: F811  # the fixture
    """make flink-cache patches what it fetches; the server factory calls the private builder."""
    assert is_patched(flink_jar)
    with zipfile.ZipFile(flink_jar) as z:
        factory = z.read("org/apache/beam/sdk/fn/server/ServerFactory$InetSocketAddressServerFactory.class")
        assert b"refinery/flink/PrivateServers" in factory
        assert "refinery/flink/SameUserOnly.class" in z.namelist()
