"""The pool's durable state in SQLite: boxes, their devices, and leases.

One file (WAL journal, so readers never wait for the writer) holds everything the
manager must remember across a restart. Allocation happens inside one ``BEGIN
IMMEDIATE`` transaction and ``leases.device`` is UNIQUE, so two attaches -- in one
process or in two -- can never get the same device. Schema changes go through
:data:`MIGRATIONS`, numbered by ``PRAGMA user_version``.

A lease moves ``attaching`` -> ``attached`` -> ``detaching`` -> (deleted)
(:class:`~dxpu_vfio.pool.states.LeaseState`). Its row
exists before anything is plugged and is deleted only after the device left the VM, so
at no moment is a device plugged without a lease; a lease left ``attaching`` or
``detaching`` by a manager that died is finished or rolled back by reconciliation.

The CHECK constraints on the state columns are written from the enums. A database keeps
the CHECK it was created with, so a new state needs a migration that rebuilds its table.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dxpu_vfio.pool.states import BoxState, LeaseState, sql_check
from dxpu_vfio.pool.storage import (  # noqa: F401 - Lease, QDEV_PREFIX, POLICIES are imported from here too
    POLICIES, QDEV_PREFIX, Lease, NoFreeDevice, StoreError, box_busy, check_allocation, check_lease_fields,
    host_fenced, host_view, no_free_device, no_such_box, no_such_device, pick_lease)

MIGRATIONS: list[str] = [
    # 1: boxes, devices, leases
    f"""
    CREATE TABLE boxes (
        name TEXT PRIMARY KEY,
        address TEXT NOT NULL,            -- host:port of its remote proxy
        tls_dir TEXT,                     -- ca.pem + host.pem/key used to reach it, NULL for plaintext
        state TEXT NOT NULL DEFAULT '{BoxState.UP}' {sql_check("state", BoxState)},
        registered_at REAL NOT NULL,
        last_seen REAL NOT NULL,
        last_error TEXT
    );
    CREATE TABLE devices (
        id TEXT PRIMARY KEY,              -- box/name
        box TEXT NOT NULL REFERENCES boxes(name) ON DELETE CASCADE,
        name TEXT NOT NULL,
        class TEXT NOT NULL,
        vendor TEXT NOT NULL,
        model TEXT NOT NULL,
        capacity INTEGER NOT NULL,
        token TEXT NOT NULL               -- unused since schema 4 (was: the box's static token)
    );
    CREATE INDEX devices_by_class ON devices(class, box);
    CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        device TEXT NOT NULL UNIQUE REFERENCES devices(id),
        vm TEXT NOT NULL,                 -- target key: qmp:/path or libvirt:name
        state TEXT NOT NULL {sql_check("state", LeaseState)},
        port TEXT, qdev_id TEXT NOT NULL, socket TEXT,
        proxy_pid INTEGER, owner_pid INTEGER,
        created_at REAL NOT NULL, updated_at REAL NOT NULL
    );
    CREATE INDEX leases_by_vm ON leases(vm);
    """,
    # 2: allocation in O(boxes + log devices): a free-device index and per-box counts,
    # kept by triggers so no code path can forget them
    """
    ALTER TABLE devices ADD COLUMN leased INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE boxes ADD COLUMN lent INTEGER NOT NULL DEFAULT 0;
    UPDATE devices SET leased = (id IN (SELECT device FROM leases));
    UPDATE boxes SET lent = (SELECT COUNT(*) FROM devices WHERE devices.box = boxes.name AND leased = 1);
    CREATE INDEX devices_free ON devices(box, class, id) WHERE leased = 0;
    CREATE TRIGGER lease_taken AFTER INSERT ON leases BEGIN
        UPDATE devices SET leased = 1 WHERE id = NEW.device@
        UPDATE boxes SET lent = lent + 1 WHERE name = (SELECT box FROM devices WHERE id = NEW.device)@
    END;
    CREATE TRIGGER lease_returned AFTER DELETE ON leases BEGIN
        UPDATE devices SET leased = 0 WHERE id = OLD.device@
        UPDATE boxes SET lent = lent - 1 WHERE name = (SELECT box FROM devices WHERE id = OLD.device)@
    END;
    """,
    # 3: the box's certificate as registered (SHA-256), checked at every heartbeat
    """
    ALTER TABLE boxes ADD COLUMN cert_sha256 TEXT;
    """,
    # 4: boxes grant a token per lease (GRANT) and no longer tell their static ones:
    # forget those an older version copied here (the column stays, empty)
    """
    UPDATE devices SET token = '';
    """,
    # 5: hosts with agents (a heartbeat row each), fencing tokens, requests to host agents
    """
    ALTER TABLE leases ADD COLUMN host TEXT;
    ALTER TABLE leases ADD COLUMN fence INTEGER;
    ALTER TABLE leases ADD COLUMN holder TEXT;
    ALTER TABLE leases ADD COLUMN request TEXT;
    ALTER TABLE leases ADD COLUMN error TEXT;
    CREATE INDEX leases_by_host ON leases(host);
    CREATE TABLE hosts (
        name TEXT PRIMARY KEY,
        holder TEXT,                      -- the running agent's heartbeat id (NULL: none registered)
        agent_pid INTEGER,
        started_at REAL,
        expires_at REAL,                  -- the agent is alive while its heartbeat keeps this ahead
        fenced_at REAL                    -- set by dxpu host fence: the host gets no device
    );
    CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
    INSERT INTO counters (name, value) VALUES ('fence', 0);
    CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
    INSERT INTO meta (name, value) VALUES ('pool_id', lower(hex(randomblob(16))));
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def _box_dict(row: sqlite3.Row) -> dict:
    return {**dict(row), "state": BoxState(row["state"])}


def default_path() -> Path:
    """$DXPU_POOL_DB, else /var/lib/dxpu/pool.db for root, else ~/.local/state/dxpu/pool.db."""
    env = os.environ.get("DXPU_POOL_DB")
    if env:
        return Path(env)
    base = Path("/var/lib/dxpu") if os.geteuid() == 0 else Path.home() / ".local/state/dxpu"
    return base / "pool.db"


def private_file(path: Path) -> None:
    """Create the database file 0600 (its directory 0700 if made here), or make an existing
    one and its WAL and shared-memory files 0600: they hold which VM has which device, and
    SQLite creates the WAL with the database's mode."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if name.stat().st_mode & 0o077:
                name.chmod(0o600)
        except FileNotFoundError:
            pass


class Store:
    """Thread-safe handle on the pool database (one connection, one lock)."""

    kind = "sqlite"
    takes_announcements = False  # a file no box can reach: boxes are registered (dxpu box add)
    watches_leases = False  # host agents poll it

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path else default_path()
        try:
            private_file(self.path)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute("PRAGMA synchronous=NORMAL")
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the pool database {self.path}: {exc}",
                             hint="check the path and free disk space, or set DXPU_POOL_DB") from exc
        self._lock = threading.RLock()
        self._ttl = 10.0  # the host lease's, once an agent registers (host_register)
        self._migrate()

    def _migrate(self) -> None:
        with self.transaction() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema version {version}; this dxpu knows up to "
                                 f"{SCHEMA_VERSION}", hint="upgrade dxpu-vfio, or use another DXPU_POOL_DB")
            for number in range(version, SCHEMA_VERSION):  # statements end with ';', trigger bodies use '@'
                for statement in filter(str.strip, MIGRATIONS[number].split(";")):
                    db.execute(statement.replace("@", ";"))
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    @property
    def pool_id(self) -> str:
        """Made with the database: fencing tokens compare only within one pool."""
        return self._query("SELECT value FROM meta WHERE name = 'pool_id'")[0][0]

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE``: takes the write lock up front, so read-then-write is atomic."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"pool database {self.path} is busy or unwritable: {exc}") from exc
            try:
                yield self._db
            except sqlite3.Error as exc:
                self._rollback()
                raise StoreError(f"pool database {self.path} failed: {exc}",
                                 hint="check free disk space and permissions; nothing was changed") from exc
            except BaseException:
                self._rollback()
                raise
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise StoreError(f"could not commit to {self.path}: {exc}",
                                 hint="check free disk space; nothing was changed") from exc

    def _rollback(self) -> None:
        if self._db.in_transaction:  # SQLite has already rolled back after e.g. SQLITE_FULL
            self._db.execute("ROLLBACK")

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- boxes and devices --------------------------------------------------------
    def register_box(self, name: str, address: str, tls_dir: str | None, devices: list[dict],
                     cert_sha256: str | None = None) -> None:
        """Add or refresh a box and its inventory; leased devices are kept as they are."""
        now = time.time()
        with self.transaction() as db:
            db.execute("INSERT INTO boxes (name, address, tls_dir, state, registered_at, last_seen, cert_sha256) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET address=excluded.address, "
                       "tls_dir=excluded.tls_dir, state=excluded.state, last_seen=excluded.last_seen, "
                       "last_error=NULL, cert_sha256=excluded.cert_sha256",
                       (name, address, tls_dir, BoxState.UP, now, now, cert_sha256))
            seen = []
            for d in devices:
                device_id = f"{name}/{d['id']}"
                seen.append(device_id)
                db.execute("INSERT INTO devices (id, box, name, class, vendor, model, capacity, token) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET class=excluded.class, "
                           "vendor=excluded.vendor, model=excluded.model, capacity=excluded.capacity, "
                           "token=excluded.token",
                           (device_id, name, d["id"], d["class"], d["vendor"], d["model"], int(d["capacity"]),
                            ""))
            marks = ",".join("?" * len(seen))
            db.execute(f"DELETE FROM devices WHERE box = ? AND id NOT IN ({marks or 'NULL'}) "
                       "AND leased = 0", (name, *seen))

    def remove_box(self, name: str) -> None:
        with self.transaction() as db:
            self._box_row(db, name)
            held = db.execute("SELECT COUNT(*) FROM leases JOIN devices ON devices.id = leases.device "
                              "WHERE devices.box = ?", (name,)).fetchone()[0]
            if held:
                raise box_busy(name, held)
            db.execute("DELETE FROM boxes WHERE name = ?", (name,))

    def _box_row(self, db: sqlite3.Connection, name: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM boxes WHERE name = ?", (name,)).fetchone()
        if row is None:
            known = [r[0] for r in db.execute("SELECT name FROM boxes ORDER BY name")]
            raise no_such_box(name, known)
        return row

    def box(self, name: str) -> dict:
        with self._lock:
            return _box_dict(self._box_row(self._db, name))

    def mark_box(self, name: str, up: bool, error: str | None = None) -> BoxState:
        """Record a heartbeat result; returns the box's state before it."""
        with self.transaction() as db:
            before = BoxState(self._box_row(db, name)["state"])
            if up:
                db.execute("UPDATE boxes SET state=?, last_seen=?, last_error=NULL WHERE name=?",
                           (BoxState.UP, time.time(), name))
            else:
                db.execute("UPDATE boxes SET state=?, last_error=? WHERE name=?", (BoxState.DOWN, error, name))
            return before

    def boxes(self) -> list[dict]:
        return [_box_dict(r) for r in self._query(
            "SELECT boxes.*, (SELECT COUNT(*) FROM devices WHERE box = boxes.name) AS devices, "
            "(SELECT COUNT(*) FROM leases JOIN devices d ON d.id = leases.device WHERE d.box = boxes.name) "
            "AS leased FROM boxes ORDER BY name")]

    def devices(self) -> list[dict]:
        rows = self._query("SELECT devices.id, devices.box, devices.name, class, vendor, model, capacity, "
                           "boxes.state AS box_state, leases.id AS lease, leases.vm AS vm "
                           "FROM devices JOIN boxes ON boxes.name = devices.box "
                           "LEFT JOIN leases ON leases.device = devices.id ORDER BY devices.id")
        return [{**dict(r), "box_state": BoxState(r["box_state"]),
                 "available": r["lease"] is None and r["box_state"] == BoxState.UP} for r in rows]

    def device(self, device_id: str) -> dict:
        rows = self._query("SELECT devices.*, boxes.address, boxes.tls_dir, boxes.cert_sha256, "
                           "boxes.state AS box_state FROM devices "
                           "JOIN boxes ON boxes.name = devices.box WHERE devices.id = ?", (device_id,))
        if not rows:
            raise no_such_device(device_id)
        return {**dict(rows[0]), "box_state": BoxState(rows[0]["box_state"])}

    # --- leases -----------------------------------------------------------------
    def allocate(self, vm: str, *, device_class: str | None = None, count: int = 1, box: str | None = None,
                 device: str | None = None, policy: str = "pack", owner_pid: int | None = None,
                 host: str | None = None) -> list[Lease]:
        """Pick ``count`` free devices and create ``attaching`` leases for them, atomically:
        all of them or none (:class:`NoFreeDevice`). Each lease gets the next fencing
        token; a fenced ``host`` gets nothing."""
        check_allocation(policy, count)
        # pack: the box that already lends the most first (keeps other boxes whole);
        # spread: the box that lends the least first, so N devices come from N boxes.
        with self.transaction() as db:
            holder = None
            if host is not None:
                row = db.execute("SELECT holder, fenced_at FROM hosts WHERE name = ?", (host,)).fetchone()
                if row is not None and row["fenced_at"] is not None:
                    raise host_fenced(host)
                holder = row["holder"] if row is not None else None
            if box:
                self._box_row(db, box)
            box_filter = " AND b.name = ?" if box else ""
            dev_filter, dev_args = "", []
            if device_class:
                dev_filter += " AND d.class = ?"
                dev_args.append(device_class)
            if device is not None:
                dev_filter += " AND d.id = ?" if "/" in device else " AND d.name = ?"
                dev_args.append(device)
            order = "b.lent DESC, b.name" if policy == "pack" else "b.lent, b.name"
            box_args = [BoxState.UP] + ([box] if box else [])
            now = time.time()
            leases = []
            for _ in range(count):
                row = db.execute(
                    f"SELECT b.name FROM boxes b WHERE b.state = ?{box_filter} AND EXISTS (SELECT 1 FROM devices d "
                    f"WHERE d.box = b.name AND d.leased = 0{dev_filter}) ORDER BY {order} LIMIT 1",
                    box_args + dev_args).fetchone()
                if row is None:
                    free = len(leases) + db.execute(
                        "SELECT COUNT(*) FROM devices d JOIN boxes b ON b.name = d.box WHERE b.state = ? "
                        f"AND d.leased = 0{box_filter}{dev_filter}", box_args + dev_args).fetchone()[0]
                    raise no_free_device(count, free, device_class, box, device)
                device_id = db.execute(f"SELECT d.id FROM devices d WHERE d.box = ? AND d.leased = 0{dev_filter} "
                                       "ORDER BY d.id LIMIT 1", [row[0]] + dev_args).fetchone()[0]
                lease_id = secrets.token_hex(4)
                fence = db.execute("UPDATE counters SET value = value + 1 WHERE name = 'fence' "
                                   "RETURNING value").fetchone()[0]
                lease = Lease(lease_id, device_id, vm, LeaseState.ATTACHING, QDEV_PREFIX + lease_id,
                              owner_pid=owner_pid, created_at=now, updated_at=now, host=host, fence=fence,
                              holder=holder)
                db.execute("INSERT INTO leases (id, device, vm, state, qdev_id, owner_pid, created_at, updated_at, "
                           "host, fence, holder) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (lease.id, device_id, vm, lease.state, lease.qdev_id, owner_pid, now, now, host, fence,
                            holder))
                leases.append(lease)
            return leases

    def update_lease(self, lease_id: str, **fields: object) -> None:
        check_lease_fields(fields)
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.transaction() as db:
            db.execute(f"UPDATE leases SET {sets}, updated_at = ? WHERE id = ?",
                       (*fields.values(), time.time(), lease_id))

    def delete_lease(self, lease_id: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    def leases(self, vm: str | None = None) -> list[Lease]:
        rows = self._query("SELECT * FROM leases WHERE vm = ? ORDER BY created_at, id", (vm,)) if vm else \
            self._query("SELECT * FROM leases ORDER BY vm, created_at, id")
        return [Lease(**dict(r)) for r in rows]

    def lease(self, lease_id: str) -> Lease | None:
        """One lease as it is now (None: deleted)."""
        rows = self._query("SELECT * FROM leases WHERE id = ?", (lease_id,))
        return Lease(**dict(rows[0])) if rows else None

    def lease_for(self, vm: str, name: str) -> Lease:
        """A VM's lease by lease id, QEMU id, device id (box/dev) or device name."""
        return pick_lease(self.leases(vm), vm, name)

    # --- hosts ------------------------------------------------------------------
    def host_register(self, host: str, ttl: float, agent_pid: int) -> str:
        """A host agent starts: a new heartbeat id (its holder) alive for ``ttl`` s; a
        fenced host is refused."""
        holder = secrets.token_hex(8)
        now = time.time()
        with self.transaction() as db:
            row = db.execute("SELECT fenced_at FROM hosts WHERE name = ?", (host,)).fetchone()
            if row is not None and row["fenced_at"] is not None:
                raise host_fenced(host)
            db.execute("INSERT INTO hosts (name, holder, agent_pid, started_at, expires_at) VALUES (?, ?, ?, ?, ?) "
                       "ON CONFLICT(name) DO UPDATE SET holder=excluded.holder, agent_pid=excluded.agent_pid, "
                       "started_at=excluded.started_at, expires_at=excluded.expires_at",
                       (host, holder, agent_pid, now, now + ttl))
        self._ttl = ttl
        return holder

    def host_keepalive(self, host: str, holder: str) -> bool:
        """Keep the agent's heartbeat alive; False once it expired, was replaced or fenced."""
        with self.transaction() as db:
            return db.execute("UPDATE hosts SET expires_at = ? WHERE name = ? AND holder = ? AND expires_at > ? "
                              "AND fenced_at IS NULL", (time.time() + self._ttl, host, holder,
                                                        time.time())).rowcount == 1

    def host_release(self, host: str, holder: str) -> None:
        with self.transaction() as db:
            db.execute("UPDATE hosts SET holder = NULL, expires_at = NULL WHERE name = ? AND holder = ?",
                       (host, holder))

    def hosts(self) -> list[dict]:
        """Hosts with an agent record or a lease."""
        records = {r["name"]: dict(r) for r in self._query("SELECT * FROM hosts")}
        held = {r[0]: r[1] for r in self._query("SELECT host, COUNT(*) FROM leases WHERE host IS NOT NULL "
                                                "GROUP BY host")}
        now = time.time()
        return [host_view(name, records.get(name), (records.get(name) or {}).get("fenced_at"), held.get(name, 0), now)
                for name in sorted(set(records) | set(held))]

    def fence_host(self, host: str) -> list[Lease]:
        """Mark ``host`` fenced (its agent's heartbeat void, no allocation for it) and take
        its leases from it, in one transaction; returns them (the caller revokes their
        tokens at the boxes)."""
        with self.transaction() as db:
            db.execute("INSERT INTO hosts (name, fenced_at) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET "
                       "fenced_at = excluded.fenced_at, holder = NULL, expires_at = NULL", (host, time.time()))
            leases = [Lease(**dict(r)) for r in db.execute("SELECT * FROM leases WHERE host = ? ORDER BY id",
                                                           (host,))]
            db.execute("DELETE FROM leases WHERE host = ?", (host,))
        return leases

    def unfence_host(self, host: str) -> None:
        with self.transaction() as db:
            if db.execute("UPDATE hosts SET fenced_at = NULL WHERE name = ? AND fenced_at IS NOT NULL",
                          (host,)).rowcount != 1:
                raise StoreError(f"host {host} is not fenced", hint="dxpu host ls shows the hosts")

    def plan_allocate(self, vm: str, **allocation: object) -> dict:
        """What :meth:`allocate` would do now, done on a copy of the database in memory
        (so the choice is exactly the allocator's); nothing here changes. Lease ids and
        fencing tokens in the answer are examples: nothing is reserved."""
        with self._lock:
            copy = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            self._db.backup(copy)
        dry = Store.__new__(Store)
        dry.path, dry._db, dry._lock = self.path, copy, threading.RLock()
        copy.row_factory = sqlite3.Row
        try:
            leases = dry.allocate(vm, **allocation)  # type: ignore[arg-type]
        finally:
            copy.close()
        sql = ["BEGIN IMMEDIATE"]
        for lease in leases:
            sql += ["UPDATE counters SET value = value + 1 WHERE name = 'fence'",
                    f"INSERT INTO leases (id, device, vm, state, host, fence) VALUES ('{lease.id}', '{lease.device}', "
                    f"'{vm}', 'attaching', {repr(lease.host) if lease.host else 'NULL'}, {lease.fence})"]
        return {"leases": leases, "transaction": sql + ["COMMIT"]}
