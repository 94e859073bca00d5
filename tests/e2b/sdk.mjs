// executor-arm's E2B-compatible API driven by the official E2B JS SDK (`e2b` on npm), unchanged:
// tests/e2b.rs starts a daemon with `[e2b] envd_listen` set and runs this with node, the SDK
// installed by scripts/e2b-npm-sdk.sh (pinned in tests/e2b/js/package-lock.json). The same flow as
// tests/e2b/test_e2b.py. Prints "e2b js: OK" and exits 0 when every step passed; exits non-zero on
// the first failure.
//
// Environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY (read by the SDK), E2B_OTHER_API_KEY (a
// service token of another service subject), E2B_JS_DIR (where scripts/e2b-npm-sdk.sh installed the
// SDK), E2B_WORKDIR (the sandbox home, default /workspace). Every wait is bounded.

import assert from 'node:assert/strict'
import { createRequire } from 'node:module'
import path from 'node:path'

const need = (name) => {
  const v = process.env[name]
  if (!v) throw new Error(`${name} is not set`)
  return v
}
for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) need(name)
const OTHER_KEY = need('E2B_OTHER_API_KEY')
const WORKDIR = process.env.E2B_WORKDIR || '/workspace'
// The SDK from the pinned install (its CommonJS build), not from wherever this file lives.
const require = createRequire(path.join(need('E2B_JS_DIR'), 'package.json'))
const { Sandbox, CommandExitError, NotFoundError, SandboxError, AuthenticationError, FileType } =
  require('e2b')

const STREAM_MS = 30_000 // a command's stream (the SDK's timeoutMs)
const POLL_MS = 20_000 // a state the server reaches by itself
const ALL_MS = 300_000 // the whole script

const overall = setTimeout(() => {
  console.error(`e2b js: not done within ${ALL_MS / 1000}s`)
  process.exit(1)
}, ALL_MS)

/** `promise`, or a failure naming `what` after `ms`. */
async function within(ms, what, promise) {
  let timer
  const limit = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`not within ${ms / 1000}s: ${what}`)), ms)
  })
  try {
    return await Promise.race([promise, limit])
  } finally {
    clearTimeout(timer)
  }
}

/** Polls `check()` until it resolves truthy (returned), failing after `ms`. */
async function until(what, check, ms = POLL_MS) {
  const deadline = Date.now() + ms
  for (;;) {
    const got = await check()
    if (got) return got
    if (Date.now() > deadline) throw new Error(`not within ${ms / 1000}s: ${what}`)
    await new Promise((r) => setTimeout(r, 100))
  }
}

/** The error `fn` rejects with, failing unless it is an instance of `cls` (one of `cls`). */
async function rejects(what, fn, cls) {
  const classes = Array.isArray(cls) ? cls : [cls]
  try {
    await fn()
  } catch (e) {
    assert.ok(
      classes.some((c) => e instanceof c),
      `${what}: expected ${classes.map((c) => c.name).join(' or ')}, got ${e?.name}: ${e?.message}`
    )
    return e
  }
  throw new Error(`${what}: did not fail`)
}

/** Every sandbox Sandbox.list() pages through (both states), by id. */
async function listed(opts) {
  const paginator = Sandbox.list(opts)
  const found = new Map()
  for (let page = 0; page < 100; page++) {
    if (!paginator.hasNext) return found
    for (const info of await paginator.nextItems()) found.set(info.sandboxId, info)
  }
  throw new Error('Sandbox.list() had more than 100 pages')
}

const pids = async (sbx) => new Set((await sbx.commands.list()).map((p) => p.pid))

/** A handle's output as it arrives: `next(suffix)` waits (bounded) until it ends with `suffix`,
 * `has(part)` until it holds `part` (a terminal's prompt may follow it in the same chunk). */
function collector() {
  let text = ''
  let waiters = []
  const wait = (what, done) =>
    within(
      STREAM_MS,
      `output ${what} (got ${JSON.stringify(text)})`,
      new Promise((resolve) => {
        if (done()) resolve(text)
        else waiters.push([done, resolve])
      })
    )
  return {
    onStdout: (data) => {
      text += data
      waiters = waiters.filter(([done, resolve]) => (done() ? (resolve(text), false) : true))
    },
    text: () => text,
    next: (suffix) => wait(`ending with ${JSON.stringify(suffix)}`, () => text.endsWith(suffix)),
    has: (part) => wait(`holding ${JSON.stringify(part)}`, () => text.includes(part)),
  }
}

const steps = []
const step = (name, fn) => steps.push([name, fn])
let sbx

step('create', async () => {
  sbx = await Sandbox.create()
  assert.ok(sbx.sandboxId)
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.ok(info.templateId)
  assert.equal(info.state, 'running')
  assert.equal(await sbx.isRunning(), true)
})

step('run echo', async () => {
  const r = await sbx.commands.run('echo hi', { timeoutMs: STREAM_MS })
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hi\n')
  assert.equal(r.stderr, '')
})

step('run in home, with envs and cwd', async () => {
  const home = await sbx.commands.run('pwd; echo $HOME', { timeoutMs: STREAM_MS })
  assert.equal(home.stdout, `${WORKDIR}\n${WORKDIR}\n`)
  const r = await sbx.commands.run('echo "$TZ"; pwd', {
    envs: { TZ: 'UTC0' },
    cwd: '/tmp',
    timeoutMs: STREAM_MS,
  })
  assert.equal(r.stdout, 'UTC0\n/tmp\n')
})

step('a failing command throws CommandExitError with its exit code', async () => {
  const e = await rejects(
    'exit 3',
    () => sbx.commands.run('echo out; echo oops >&2; exit 3', { timeoutMs: STREAM_MS }),
    CommandExitError
  )
  assert.equal(e.exitCode, 3)
  assert.equal(e.stdout, 'out\n')
  assert.equal(e.stderr, 'oops\n')
})

step('background command: connect, read, kill', async () => {
  const h = await sbx.commands.run('for i in $(seq 1 600); do echo line$i; sleep 0.1; done', {
    background: true,
    timeoutMs: STREAM_MS,
  })
  const pid = h.pid
  assert.ok(pid > 0)
  await h.disconnect() // the SDK stops listening; the command goes on
  assert.ok((await pids(sbx)).has(pid))

  const out = collector()
  const c = await sbx.commands.connect(pid, { onStdout: out.onStdout, timeoutMs: STREAM_MS })
  assert.equal(c.pid, pid)
  await out.next('\n')
  assert.match(out.text(), /line\d+\n/)

  assert.equal(await sbx.commands.kill(pid), true)
  const e = await within(STREAM_MS, 'the killed command ends', rejects('wait after kill', () => c.wait(), CommandExitError))
  assert.notEqual(e.exitCode, 0)
  await until(`pid ${pid} leaves commands.list()`, async () => !(await pids(sbx)).has(pid))
  assert.equal(await sbx.commands.kill(pid), false)
})

step('send stdin', async () => {
  const h = await sbx.commands.run('head -n1', { background: true, stdin: true, timeoutMs: STREAM_MS })
  await sbx.commands.sendStdin(h.pid, 'hello stdin\n')
  const r = await within(STREAM_MS, 'head -n1 ends', h.wait())
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello stdin\n')

  const out = collector()
  const cat = await sbx.commands.run('cat', {
    background: true,
    stdin: true,
    onStdout: out.onStdout,
    timeoutMs: STREAM_MS,
  })
  await sbx.commands.sendStdin(cat.pid, 'first\n')
  assert.equal(await out.next('first\n'), 'first\n')
  await cat.sendStdin(new TextEncoder().encode('second\n'))
  assert.equal(await out.next('second\n'), 'first\nsecond\n')
  assert.equal(await cat.kill(), true)
  await within(STREAM_MS, 'the killed cat ends', rejects('wait after kill', () => cat.wait(), CommandExitError))
})

step('pty: type, resize, connect, exit, kill', async () => {
  const decoder = new TextDecoder()
  const out = collector()
  const onData = (bytes) => out.onStdout(decoder.decode(bytes, { stream: true }))
  const h = await sbx.pty.create({ cols: 100, rows: 30, onData, envs: { TZ: 'UTC0' }, timeoutMs: STREAM_MS })
  assert.ok(h.pid > 0)
  assert.ok((await pids(sbx)).has(h.pid))
  const type = (text) => sbx.pty.sendInput(h.pid, new TextEncoder().encode(text))
  await type('stty size; pwd; echo tz=$TZ; echo typed-$((2+3))\n')
  await out.has('typed-5\r\n')
  assert.ok(out.text().includes('30 100\r\n'), out.text())
  assert.ok(out.text().includes(`${WORKDIR}\r\n`), out.text())
  assert.ok(out.text().includes('tz=UTC0\r\n'), out.text())
  await sbx.pty.resize(h.pid, { cols: 120, rows: 40 })
  await type('stty size\n')
  await out.has('40 120\r\n')
  await type('exit 3\n')
  const e = await within(STREAM_MS, 'the PTY ends', rejects('wait after exit', () => h.wait(), CommandExitError))
  assert.equal(e.exitCode, 3)
  await until(`pty ${h.pid} leaves commands.list()`, async () => !(await pids(sbx)).has(h.pid))

  // Another PTY, followed by a second caller, then killed.
  const second = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {}, timeoutMs: STREAM_MS })
  await second.disconnect()
  const again = collector()
  const c = await sbx.pty.connect(second.pid, {
    onData: (bytes) => again.onStdout(decoder.decode(bytes, { stream: true })),
    timeoutMs: STREAM_MS,
  })
  await sbx.pty.sendInput(second.pid, new TextEncoder().encode('echo re$((1+1))attached\n'))
  await again.has('re2attached\r\n')
  assert.equal(await sbx.pty.kill(second.pid), true)
  await within(STREAM_MS, 'the killed PTY ends', rejects('wait after kill', () => c.wait(), CommandExitError))
  assert.equal(await sbx.pty.kill(second.pid), false)
})

step('files', async () => {
  const w = await sbx.files.write('notes/a.txt', 'hello')
  assert.equal(w.path, `${WORKDIR}/notes/a.txt`)
  assert.equal(w.name, 'a.txt')
  assert.equal(await sbx.files.read('notes/a.txt'), 'hello')
  assert.equal(await sbx.files.read(`${WORKDIR}/notes/a.txt`), 'hello')
  assert.equal((await sbx.commands.run('cat notes/a.txt', { timeoutMs: STREAM_MS })).stdout, 'hello')
  assert.equal(await sbx.files.exists('notes/a.txt'), true)
  assert.equal(await sbx.files.exists('notes/missing.txt'), false)

  const blob = new Uint8Array(1024).map((_, i) => i % 256)
  await sbx.files.write('notes/a.txt', blob.buffer)
  assert.deepEqual(new Uint8Array(await sbx.files.read('notes/a.txt', { format: 'bytes' })), blob)
  await sbx.files.write('notes/a.txt', 'hello')

  assert.equal(await sbx.files.makeDir('d1'), true)
  assert.equal(await sbx.files.makeDir('d1'), false)
  assert.equal(await sbx.files.makeDir('d1/x/y'), true)

  const top = new Map((await sbx.files.list(WORKDIR)).map((e) => [e.name, e]))
  assert.equal(top.get('notes')?.type, FileType.DIR)
  assert.equal(top.get('d1')?.type, FileType.DIR)
  assert.equal(top.get('d1')?.path, `${WORKDIR}/d1`)
  const entries = await sbx.files.list('notes')
  assert.deepEqual(
    entries.map((e) => [e.name, e.type, e.path, e.size]),
    [['a.txt', FileType.FILE, `${WORKDIR}/notes/a.txt`, 5]]
  )
  assert.ok(entries[0].modifiedTime instanceof Date)

  const moved = await sbx.files.rename('notes/a.txt', 'd1/b.txt')
  assert.equal(moved.name, 'b.txt')
  assert.equal(moved.path, `${WORKDIR}/d1/b.txt`)
  assert.equal(await sbx.files.exists('notes/a.txt'), false)
  assert.equal(await sbx.files.read('d1/b.txt'), 'hello')
  const got = await sbx.files.getInfo('d1/b.txt')
  assert.deepEqual([got.type, got.size], [FileType.FILE, 5])

  await sbx.files.remove('d1/b.txt')
  assert.equal(await sbx.files.exists('d1/b.txt'), false)
  await rejects('read a removed file', () => sbx.files.read('d1/b.txt'), NotFoundError)
  await sbx.files.remove('d1')
  assert.equal(await sbx.files.exists('d1'), false)
})

step('setTimeout, getInfo, list', async () => {
  await sbx.setTimeout(120_000)
  const info = await sbx.getInfo()
  const now = Date.now()
  assert.ok(info.startedAt.getTime() <= now)
  const left = (info.endAt.getTime() - now) / 1000
  assert.ok(left > 60 && left <= 130, `endAt is ${left}s away`)
  assert.ok(info.envdVersion)
  const all = await listed()
  assert.equal(all.get(sbx.sandboxId)?.state, 'running')
})

step('another service cannot reach the sandbox', async () => {
  const id = sbx.sandboxId
  const other = { apiKey: OTHER_KEY }
  await rejects('getInfo with another key', () => Sandbox.getInfo(id, other), NotFoundError)
  await rejects('connect with another key', () => Sandbox.connect(id, other), NotFoundError)
  assert.equal(await Sandbox.kill(id, other), false)
  assert.equal((await listed(other)).has(id), false)
  assert.equal((await Sandbox.getInfo(id)).state, 'running')
  assert.equal((await sbx.commands.run('echo still', { timeoutMs: STREAM_MS })).stdout, 'still\n')
})

step('pause, connect, kill', async () => {
  const s = await Sandbox.create()
  const id = s.sandboxId
  try {
    await s.files.write('keep.txt', 'kept')
    await s.commands.run('echo more >> keep.txt', { timeoutMs: STREAM_MS })
    assert.equal(await s.pause(), true)
    assert.equal((await Sandbox.getInfo(id)).state, 'paused')
    assert.equal((await listed()).get(id)?.state, 'paused')

    const s2 = await Sandbox.connect(id)
    assert.equal(s2.sandboxId, id)
    assert.equal((await Sandbox.getInfo(id)).state, 'running')
    assert.equal(await s2.files.read('keep.txt'), 'keptmore\n')
    assert.equal((await s2.commands.run('cat keep.txt', { timeoutMs: STREAM_MS })).stdout, 'keptmore\n')

    assert.equal(await Sandbox.pause(id), true)
    assert.equal((await Sandbox.getInfo(id)).state, 'paused')
    await s.connect()
    assert.equal((await Sandbox.getInfo(id)).state, 'running')
    assert.equal((await s.commands.run('cat keep.txt', { timeoutMs: STREAM_MS })).stdout, 'keptmore\n')

    assert.equal(await s2.kill(), true)
    await rejects('getInfo of a killed sandbox', () => Sandbox.getInfo(id), NotFoundError)
    assert.equal(await Sandbox.kill(id), false)
    assert.equal((await listed()).has(id), false)
    await rejects(
      'a command in a killed sandbox',
      () => s.commands.run('echo gone', { timeoutMs: STREAM_MS, requestTimeoutMs: STREAM_MS }),
      [SandboxError, AuthenticationError]
    )
  } finally {
    await Sandbox.kill(id).catch(() => {})
  }
})

let failed = false
try {
  for (const [name, fn] of steps) {
    const started = Date.now()
    try {
      await fn()
    } catch (e) {
      console.error(`FAIL ${name}: ${e?.stack || e}`)
      failed = true
      break
    }
    console.log(`ok ${name} (${Date.now() - started} ms)`)
  }
} finally {
  if (sbx) await sbx.kill().catch(() => {})
}
clearTimeout(overall)
if (failed) process.exit(1)
console.log('e2b js: OK')
process.exit(0)
