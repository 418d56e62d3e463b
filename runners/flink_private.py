"""Beam's Flink job server jar, patched so that its gRPC servers serve this machine's user only.

The JVM that ``--runner flink`` starts (Beam's ``FlinkJobServerDriver``) serves the job API,
artifact staging, the Java expansion service and, for each job, the Fn API services its SDK
workers dial. Beam builds each with ``NettyServerBuilder.forPort(port)``, which listens on
every interface, or ``forAddress(address)``, and takes any caller: another user who reaches a
port can submit a job that runs as you (``tests/test_runner_sockets.py::test_a_flink_run``).
Beam has no flag for either.

:func:`patch_jar` changes that in the jar itself, without Beam's sources: every call of those
two builder methods in Beam's own classes (``org/apache/beam/``, not its vendored libraries)
is redirected, in the class file's constant pool, to :data:`PRIVATE_SERVERS_JAVA`'s methods of
the same signature. They listen on loopback (a wildcard address becomes ``127.0.0.1``) and
add :data:`SAME_USER_JAVA`, a server interceptor that refuses, with ``PERMISSION_DENIED``
before any handler runs, a call whose TCP peer is a socket of another uid: the Java twin of
:class:`refinery.runners.same_user.SameUserOnly` (``/proc/net/tcp`` and ``tcp6``). Both
classes are compiled here (``javac --release 8`` against the jar) and added with the JDK's
``jar`` tool, with :data:`MARKER` naming :data:`PATCH_ID`. A jar without that marker is
refused by ``--runner flink`` (:func:`refinery.runners.flink.runnable`) in one line naming
the command that patches it (``python -m refinery.runners.flink_local patch JAR``).
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import struct
import subprocess
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

PATCH_ID = "private-servers-2"
MARKER = "META-INF/refinery/private-servers"
TARGET = "refinery/flink/PrivateServers"
BUILDER_RE = re.compile(r"^(org/apache/beam/vendor/grpc/[^/]+/io/grpc)/netty/NettyServerBuilder\.class$")
# the classes whose servers the job server starts: each must have a call redirected, else Beam changed
REQUIRED = ("org/apache/beam/sdk/fn/server/ServerFactory$InetSocketAddressServerFactory.class",
            "org/apache/beam/sdk/expansion/service/ExpansionServer.class")


class JarPatchError(RuntimeError):
    """The jar could not be patched; the message names the jar or class and why."""


def is_patched(jar: Path) -> bool:
    """Whether ``jar`` carries this module's patch (:data:`MARKER` reading :data:`PATCH_ID`)."""
    try:
        with zipfile.ZipFile(jar) as z:
            return z.read(MARKER).decode().strip() == PATCH_ID
    except (KeyError, OSError, zipfile.BadZipFile):
        return False


def grpc_package(names: list[str]) -> str:
    """The vendored gRPC package (``org/apache/beam/vendor/grpc/v1p60p1/io/grpc``) of a jar's entry names."""
    found = sorted({m.group(1) for n in names if (m := BUILDER_RE.match(n))})
    if len(found) != 1:
        raise JarPatchError(f"expected one vendored gRPC NettyServerBuilder in the jar, found {found or 'none'}")
    return found[0]


# ---- class files -------------------------------------------------------------------------

_SIZES = {3: 4, 4: 4, 5: 8, 6: 8, 7: 2, 8: 2, 9: 4, 10: 4, 11: 4, 12: 4, 15: 3, 16: 2, 17: 4, 18: 4, 19: 2, 20: 2}


def redirect_calls(data: bytes, owner: str, methods: dict[str, str], target: str) -> tuple[bytes, int]:
    """``data`` (a class file) with every ``Methodref`` to ``owner.name`` (for ``name`` ->
    descriptor in ``methods``) made a reference to ``target.name`` of the same descriptor: a
    new Class entry is appended to the constant pool and the Methodrefs point at it, so no
    code, offset or stack map changes. (new bytes, how many Methodrefs were redirected)."""
    if data[:4] != b"\xca\xfe\xba\xbe":
        raise JarPatchError("not a class file")
    count = struct.unpack_from(">H", data, 8)[0]
    pos, index = 10, 1
    utf8: dict[int, str] = {}
    classes: dict[int, int] = {}
    name_types: dict[int, tuple[int, int]] = {}
    methodrefs: list[tuple[int, int, int]] = []  # (offset of class_index, class_index, name_and_type_index)
    while index < count:
        tag = data[pos]
        if tag == 1:
            length = struct.unpack_from(">H", data, pos + 1)[0]
            utf8[index] = data[pos + 3:pos + 3 + length].decode("utf-8", "surrogatepass")
            pos += 3 + length
        elif tag in _SIZES:
            if tag == 7:
                classes[index] = struct.unpack_from(">H", data, pos + 1)[0]
            elif tag == 12:
                name_types[index] = struct.unpack_from(">HH", data, pos + 1)
            elif tag == 10:
                cls, nat = struct.unpack_from(">HH", data, pos + 1)
                methodrefs.append((pos + 1, cls, nat))
            pos += 1 + _SIZES[tag]
        else:
            raise JarPatchError(f"unknown constant pool tag {tag} at entry {index}")
        index += 2 if tag in (5, 6) else 1
    hits = []
    for offset, cls, nat in methodrefs:
        if utf8.get(classes.get(cls, -1)) != owner:
            continue
        name_i, desc_i = name_types[nat]
        if methods.get(utf8[name_i]) == utf8[desc_i]:
            hits.append(offset)
    if not hits:
        return data, 0
    name = target.encode()
    added = b"\x01" + struct.pack(">H", len(name)) + name + b"\x07" + struct.pack(">H", count)
    out = bytearray(data[:pos] + added + data[pos:])
    struct.pack_into(">H", out, 8, count + 2)
    for offset in hits:
        struct.pack_into(">H", out, offset, count + 1)
    return bytes(out), len(hits)


# ---- the jar -----------------------------------------------------------------------------


def _jdk_tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        raise JarPatchError(f"{name} (from a JDK) is not on PATH: it builds refinery's patch of the Flink job server")
    return found


def patch_jar(jar: Path, dest: Path | None = None, log: Callable[[str], object] = print) -> dict[str, int]:
    """Write ``jar`` patched (see the module docstring) to ``dest`` (default: ``jar`` itself,
    replaced atomically); a patched jar is copied as it is. Returns the redirected calls per
    class; raises :class:`JarPatchError`."""
    dest = dest or jar
    if is_patched(jar):
        if dest != jar:
            shutil.copyfile(jar, dest)
        return {}
    javac, jar_tool = _jdk_tool("javac"), _jdk_tool("jar")
    with zipfile.ZipFile(jar) as z:
        names = z.namelist()
        package = grpc_package(names)
        builder = f"{package}/netty/NettyServerBuilder"
        methods = {"forPort": f"(I)L{builder};", "forAddress": f"(Ljava/net/SocketAddress;)L{builder};"}
        patched: dict[str, bytes] = {}
        counts: dict[str, int] = {}
        for n in names:
            ours = n.startswith("org/apache/beam/") and not n.startswith("org/apache/beam/vendor/")
            if not (ours and n.endswith(".class")):
                continue
            data = z.read(n)
            if builder.encode() in data:
                new, hits = redirect_calls(data, builder, methods, TARGET)
                if hits:
                    patched[n], counts[n] = new, hits
    missing = [n for n in REQUIRED if n not in counts]
    if missing:
        raise JarPatchError(f"{jar}: no NettyServerBuilder.forPort/forAddress call to redirect in {', '.join(missing)} "
                         "(a Beam version this patch does not know)")
    log(f"{jar.name}: serving this user only ({sum(counts.values())} server builder calls in {len(counts)} classes)")
    with tempfile.TemporaryDirectory(prefix="refinery-flink-patch-") as tmp:
        root = Path(tmp)
        src, out = root / "src" / "refinery" / "flink", root / "out"
        src.mkdir(parents=True)
        dotted = package.replace("/", ".")
        (src / "SameUserOnly.java").write_text(SAME_USER_JAVA.replace("@GRPC@", dotted))
        (src / "PrivateServers.java").write_text(PRIVATE_SERVERS_JAVA.replace("@GRPC@", dotted))
        r = subprocess.run([javac, "--release", "8", "-nowarn", "-cp", str(jar), "-d", str(out),
                            *map(str, sorted(src.glob("*.java")))], capture_output=True, text=True)
        if r.returncode != 0:
            raise JarPatchError(f"javac could not build refinery's patch against {jar}: {r.stderr.strip()[:500]}")
        for n, data in patched.items():
            (out / n).parent.mkdir(parents=True, exist_ok=True)
            (out / n).write_bytes(data)
        (out / MARKER).parent.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text(PATCH_ID + "\n")
        dest.parent.mkdir(parents=True, exist_ok=True)
        work = dest.with_name(dest.name + ".patching")
        shutil.copyfile(jar, work)
        r = subprocess.run([jar_tool, "uf", str(work), "-C", str(out), "."], capture_output=True, text=True)
        if r.returncode != 0:
            work.unlink(missing_ok=True)
            raise JarPatchError(f"jar uf {work}: {r.stderr.strip()[:500]}")
        work.replace(dest)
    if not is_patched(dest):
        raise JarPatchError(f"{dest}: patched, yet its marker {MARKER} does not read {PATCH_ID}")
    return counts


# ---- the embedded Flink's own ports ------------------------------------------------------

TLS_DIR = "tls"
KEYSTORE = "keystore.p12"
CONF = "config.yaml"


def embedded_flink_conf(root: Path, log: Callable[[str], object] = print) -> Path:
    """A ``FLINK_CONF_DIR`` for the Flink that Beam's job server embeds (``--flink_master
    [auto]`` or ``[local]``): ``root/tls-<uid>``, a folder only this user can enter (0700).

    That Flink starts a REST server (which takes job submissions) and a blob server, on every
    interface and for anyone. The configuration binds both to localhost and turns on Flink's
    TLS with mutual authentication for REST and for its internal connections, with a key that
    only this user can read (a self-signed PKCS12 keystore, its own truststore, made once with
    the JDK's ``keytool``): a caller without the key fails the TLS handshake. Nothing of the
    job itself goes over these ports (Beam submits to the embedded Flink in-process)."""
    folder = root / f"{TLS_DIR}-{os.getuid()}"  # one per user: a cache may be shared
    try:
        folder.mkdir(parents=True, exist_ok=True)
        info = folder.stat()
        if info.st_uid != os.getuid():
            raise JarPatchError(f"{folder} belongs to uid {info.st_uid}, not to this user: the embedded Flink's key "
                             "must be this user's alone (remove the folder)")
        folder.chmod(0o700)
    except OSError as e:
        raise JarPatchError(f"{folder}: cannot keep the embedded Flink's key there ({e.strerror})") from None
    keystore, conf = folder / KEYSTORE, folder / CONF
    if not (keystore.exists() and conf.exists()):
        keytool = _jdk_tool("keytool")
        password = secrets.token_urlsafe(24)
        work = folder / (KEYSTORE + ".new")
        work.unlink(missing_ok=True)
        log(f"embedded Flink: a private TLS key for its REST and blob servers ({folder})")
        r = subprocess.run([keytool, "-genkeypair", "-alias", "flink", "-keyalg", "RSA", "-keysize", "2048",
                            "-dname", "CN=localhost", "-validity", "36500", "-storetype", "PKCS12",
                            "-keystore", str(work), "-storepass", password, "-keypass", password],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise JarPatchError(f"keytool could not make the embedded Flink's key in {folder}: "
                                f"{r.stderr.strip()[:300]}")
        work.chmod(0o600)
        lines = ["rest.bind-address: localhost", "jobmanager.bind-host: localhost",
                 "taskmanager.bind-host: localhost"]
        for scope in ("rest", "internal"):
            lines += [f"security.ssl.{scope}.enabled: true"]
            for store in ("keystore", "truststore"):
                lines += [f"security.ssl.{scope}.{store}: {keystore}", f"security.ssl.{scope}.{store}-type: PKCS12",
                          f"security.ssl.{scope}.{store}-password: {password}"]
            lines += [f"security.ssl.{scope}.key-password: {password}"]
        lines += ["security.ssl.rest.authentication-enabled: true"]
        fd = os.open(conf.with_suffix(".new"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# written by refinery.runners.flink_private: the embedded Flink, private to this user\n")
            f.write("\n".join(lines) + "\n")
        work.replace(keystore)
        conf.with_suffix(".new").replace(conf)
    return folder


SAME_USER_JAVA = r"""package refinery.flink;

import java.io.IOException;
import java.net.Inet4Address;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.Arrays;
import java.util.List;
import @GRPC@.Grpc;
import @GRPC@.Metadata;
import @GRPC@.ServerCall;
import @GRPC@.ServerCallHandler;
import @GRPC@.ServerInterceptor;
import @GRPC@.Status;

/** Refuses a call whose TCP peer is a socket of another uid (or of no socket on this machine). */
public final class SameUserOnly implements ServerInterceptor {
  private static final String[] TABLES = {"/proc/net/tcp", "/proc/net/tcp6"};
  private final long uid = ownUid();

  @Override
  public <ReqT, RespT> ServerCall.Listener<ReqT> interceptCall(
      ServerCall<ReqT, RespT> call, Metadata headers, ServerCallHandler<ReqT, RespT> next) {
    String why = refusal(call.getAttributes().get(Grpc.TRANSPORT_ATTR_REMOTE_ADDR));
    if (why != null) {
      call.close(Status.PERMISSION_DENIED.withDescription(why), new Metadata());
      return new ServerCall.Listener<ReqT>() {};
    }
    return next.startCall(call, headers);
  }

  String refusal(SocketAddress peer) {
    if (!(peer instanceof InetSocketAddress)) {
      return null; // a unix socket: its folder keeps other users out
    }
    InetSocketAddress inet = (InetSocketAddress) peer;
    Long owner = owner(plain(inet.getAddress()), inet.getPort());
    if (owner == null) {
      return "refinery: a call from " + peer + ": no socket of this machine; only uid " + uid + " is served";
    }
    if (owner != uid) {
      return "refinery: a call from " + peer + " (uid " + owner + ") refused: only uid " + uid + " is served";
    }
    return null;
  }

  /** The uid of the non-listening TCP socket whose local address is ip:port, or null. */
  static Long owner(byte[] ip, int port) {
    for (String table : TABLES) {
      List<String> lines;
      try {
        lines = Files.readAllLines(Paths.get(table), StandardCharsets.US_ASCII);
      } catch (IOException e) {
        continue;
      }
      for (String line : lines.subList(Math.min(1, lines.size()), lines.size())) {
        String[] f = line.trim().split("\\s+");
        if (f.length < 8 || f[3].equals("0A")) {
          continue; // 0A: a listening socket
        }
        int colon = f[1].indexOf(':');
        try {
          if (Integer.parseInt(f[1].substring(colon + 1), 16) == port
              && Arrays.equals(plain(tableAddress(f[1].substring(0, colon))), ip)) {
            return Long.parseLong(f[7]);
          }
        } catch (RuntimeException e) {
          // a row this reader does not understand: not the peer
        }
      }
    }
    return null;
  }

  /** An address of /proc/net/tcp{,6}: 32-bit words in little-endian order. */
  static byte[] tableAddress(String hex) {
    byte[] raw = new byte[hex.length() / 2];
    for (int i = 0; i < raw.length; i++) {
      raw[i] = (byte) Integer.parseInt(hex.substring(2 * i, 2 * i + 2), 16);
    }
    byte[] out = new byte[raw.length];
    for (int w = 0; w < raw.length; w += 4) {
      for (int b = 0; b < 4; b++) {
        out[w + b] = raw[w + 3 - b];
      }
    }
    return out;
  }

  /** An IPv4-mapped IPv6 address as its 4 IPv4 bytes; any other address as it is. */
  static byte[] plain(byte[] a) {
    if (a.length == 16) {
      boolean mapped = a[10] == (byte) 0xff && a[11] == (byte) 0xff;
      for (int i = 0; i < 10 && mapped; i++) {
        mapped = a[i] == 0;
      }
      if (mapped) {
        return Arrays.copyOfRange(a, 12, 16);
      }
    }
    return a;
  }

  static byte[] plain(InetAddress a) {
    return plain(a.getAddress());
  }

  static long ownUid() {
    try {
      for (String line : Files.readAllLines(Paths.get("/proc/self/status"), StandardCharsets.US_ASCII)) {
        if (line.startsWith("Uid:")) {
          return Long.parseLong(line.substring(4).trim().split("\\s+")[0]);
        }
      }
    } catch (IOException | RuntimeException e) {
      throw new IllegalStateException("refinery: cannot read this process's uid from /proc/self/status", e);
    }
    throw new IllegalStateException("refinery: /proc/self/status names no Uid");
  }
}
"""

PRIVATE_SERVERS_JAVA = r"""package refinery.flink;

import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.io.InputStream;
import java.net.SocketAddress;
import @GRPC@.HandlerRegistry;
import @GRPC@.Metadata;
import @GRPC@.MethodDescriptor;
import @GRPC@.ServerCall;
import @GRPC@.ServerCallHandler;
import @GRPC@.ServerMethodDefinition;
import @GRPC@.Status;
import @GRPC@.netty.NettyServerBuilder;

/** What Beam's gRPC servers are built with instead of NettyServerBuilder.forPort/forAddress. */
public final class PrivateServers {
  private PrivateServers() {}

  /** For forPort(port), which listens on every interface: loopback only, this uid only. */
  public static NettyServerBuilder forPort(int port) {
    return forAddress(new InetSocketAddress(InetAddress.getLoopbackAddress(), port));
  }

  /** For forAddress(address): a wildcard address becomes loopback; this uid only. */
  public static NettyServerBuilder forAddress(SocketAddress address) {
    SocketAddress where = address;
    if (address instanceof InetSocketAddress && ((InetSocketAddress) address).getAddress() != null
        && ((InetSocketAddress) address).getAddress().isAnyLocalAddress()) {
      where = new InetSocketAddress(InetAddress.getLoopbackAddress(), ((InetSocketAddress) address).getPort());
    }
    return NettyServerBuilder.forAddress(where).intercept(new SameUserOnly())
        .fallbackHandlerRegistry(new UnknownMethods());
  }

  /**
   * Unknown methods go through the interceptors too: grpc-java answers them UNIMPLEMENTED before
   * any interceptor runs, which tells another user what the server is.
   */
  static final class UnknownMethods extends HandlerRegistry {
    private static final MethodDescriptor.Marshaller<InputStream> RAW =
        new MethodDescriptor.Marshaller<InputStream>() {
          @Override
          public InputStream stream(InputStream value) {
            return value;
          }

          @Override
          public InputStream parse(InputStream stream) {
            return stream;
          }
        };

    @Override
    public ServerMethodDefinition<?, ?> lookupMethod(final String methodName, String authority) {
      MethodDescriptor<InputStream, InputStream> method =
          MethodDescriptor.<InputStream, InputStream>newBuilder()
              .setType(MethodDescriptor.MethodType.UNKNOWN)
              .setFullMethodName(methodName)
              .setRequestMarshaller(RAW)
              .setResponseMarshaller(RAW)
              .build();
      return ServerMethodDefinition.create(method, new ServerCallHandler<InputStream, InputStream>() {
        @Override
        public ServerCall.Listener<InputStream> startCall(
            ServerCall<InputStream, InputStream> call, Metadata headers) {
          call.close(Status.UNIMPLEMENTED.withDescription("Method not found: " + methodName), new Metadata());
          return new ServerCall.Listener<InputStream>() {};
        }
      });
    }
  }
}
"""
